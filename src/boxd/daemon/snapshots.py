"""Snapshot policy: named, versioned baselines that outlive the machine they came from.

Saving takes a checkpoint of the machine (its only pause) and answers at once with a
``saving`` version; the checkpoint is then written out, compressed, in the background
and dropped. The version becomes ``ready`` with its content digest, or ``failed`` with
the reason. A version is never changed after that; saving a name again adds a version.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging

from boxd.daemon.logs import event
from boxd.daemon.machines import ClosableRuntime, MachineService, reason_of
from boxd.daemon.store import Store
from boxd.errors import Conflict, NotFound
from boxd.models import Snapshot, SnapshotCreate, SnapshotState

log = logging.getLogger(__name__)


class SnapshotService:
    def __init__(self, store: Store, runtime: ClosableRuntime, machines: MachineService) -> None:
        self._store = store
        self._runtime = runtime
        self._machines = machines
        self._progress: dict[tuple[str, str, int], float] = {}
        self._saving: set[asyncio.Task] = set()

    async def recover(self) -> None:
        """Versions a dead daemon was still writing are failed; their checkpoints are dropped."""
        for account, snapshot, capture in self._store.saving_snapshots():
            if capture is not None:
                with contextlib.suppress(NotFound):
                    await self._runtime.drop_checkpoint(snapshot.machine, capture)
            self._store.finish_snapshot(
                account, snapshot.name, snapshot.version, reason="the daemon stopped while it was being saved"
            )

    async def close(self) -> None:
        for task in list(self._saving):
            task.cancel()
        await asyncio.gather(*self._saving, return_exceptions=True)

    async def save(self, account: str, request: SnapshotCreate) -> Snapshot:
        machine = await self._machines.usable(account, request.machine)
        taken = await self._runtime.checkpoint(machine.id)
        try:
            snapshot = self._store.add_snapshot(account, request.name, machine, taken.id, round(taken.pause_s * 1000, 1))
        except BaseException:
            await self._runtime.drop_checkpoint(machine.id, taken.id)
            raise
        event(log, "snapshot.saving", account=account, snapshot=snapshot.ref, machine=machine.id,
              pause_ms=snapshot.pause_ms)
        key = (account, snapshot.name, snapshot.version)
        self._progress[key] = 0.0
        task = asyncio.create_task(self._write(account, snapshot, taken.id), name=f"snapshot-{snapshot.ref}")
        self._saving.add(task)
        task.add_done_callback(self._saving.discard)
        return self._with_progress(account, snapshot)

    async def _write(self, account: str, snapshot: Snapshot, capture: str) -> None:
        key = (account, snapshot.name, snapshot.version)

        def progress(done: int, total: int) -> None:
            self._progress[key] = done / total if total else 0.0

        try:
            # Under the machine's lock: deleting it waits until its snapshot is written.
            async with self._machines.lifecycle_lock(snapshot.machine):
                try:
                    manifest = await self._runtime.save_snapshot(snapshot.machine, capture, progress)
                finally:
                    with contextlib.suppress(NotFound):
                        await self._runtime.drop_checkpoint(snapshot.machine, capture)
        except Exception as error:
            self._store.finish_snapshot(account, snapshot.name, snapshot.version, reason=reason_of(error))
            event(log, "snapshot.failed", level=logging.WARNING, account=account, snapshot=snapshot.ref,
                  reason=reason_of(error))
        else:
            self._store.finish_snapshot(
                account, snapshot.name, snapshot.version, digest=manifest.digest, size_bytes=manifest.size_bytes
            )
            event(log, "snapshot.ready", account=account, snapshot=snapshot.ref, digest=manifest.digest,
                  size_bytes=manifest.size_bytes)
        finally:
            self._progress.pop(key, None)

    def _with_progress(self, account: str, snapshot: Snapshot) -> Snapshot:
        if snapshot.state is not SnapshotState.SAVING:
            return snapshot
        return snapshot.model_copy(update={"progress": self._progress.get((account, snapshot.name, snapshot.version))})

    def get(self, account: str, ref: str) -> Snapshot:
        return self._with_progress(account, self._store.find_snapshot(account, ref))

    def list(self, account: str) -> list[Snapshot]:
        return [self._with_progress(account, snapshot) for snapshot in self._store.list_snapshots(account)]

    async def delete(self, account: str, ref: str) -> list[Snapshot]:
        """NAME@VERSION (or a digest) deletes that version; NAME deletes every version of it."""
        if "@" in ref or self._store.snapshot_versions(account, ref) == []:
            doomed = [self._store.find_snapshot(account, ref)]
        else:
            doomed = self._store.snapshot_versions(account, ref)
        if any(snapshot.state is SnapshotState.SAVING for snapshot in doomed):
            raise Conflict(f"snapshot {ref} is still being saved", field="snapshot")
        for snapshot in doomed:
            if self._store.delete_snapshot(account, snapshot.name, snapshot.version) and snapshot.digest:
                await self._runtime.delete_snapshot(snapshot.digest)
            event(log, "snapshot.deleted", account=account, snapshot=snapshot.ref)
        return doomed
