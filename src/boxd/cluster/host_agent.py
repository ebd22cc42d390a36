"""The boxd host agent: the VMs of one Ray node, owned by one long-lived actor.

Its QEMU processes run in sessions of their own (as with the single-host daemon), so
they outlive the agent: Ray kills a dead worker's process group, not theirs, and a new
agent adopts them from its state directory. Everything it takes and gives is plain data
(the runtime interface's dataclasses), so that Ray can carry it; what streams (command
output, downloads, watches) are Ray streaming generators, and an upload comes in parts.
"""

from __future__ import annotations

import asyncio
import inspect
import logging
import os
import secrets
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

from boxd.cluster.placement import HostLoad
from boxd.errors import HostError, InvalidInput
from boxd.runtime.agent_client import ExecEvent
from boxd.runtime.interface import ExecRequest, VMSpec
from boxd.runtime.snapshots import read_chunk, receive_snapshot, snapshot_digests

log = logging.getLogger(__name__)

# The runtime calls the daemon may make through ``call``; the streaming ones have methods.
CALLS = frozenset({
    "create", "adopt", "info", "wait_ready", "delete", "fork", "checkpoint", "restore", "drop_checkpoint",
    "save_snapshot", "delete_snapshot", "suspend", "hibernate", "resume", "collect_garbage", "fs", "process",
    # a fork across hosts
    "spec_of", "receive_capture", "finish_capture", "drop_capture", "capture_to", "export_size", "drop_export",
    "fork_from",
})


def _memory_mib(field: str) -> int:
    with open("/proc/meminfo") as meminfo:
        for line in meminfo:
            if line.startswith(field + ":"):
                return int(line.split()[1]) // 1024
    raise HostError(f"/proc/meminfo has no {field}")


class HostAgent:
    """Made by ``RayRuntime`` as a detached actor named ``boxd-host-<node id>``."""

    def __init__(self, name: str, node_id: str, home: str, api_address: tuple[str, int] | None,
                 daemon_home: str | None = None, capacity_mib: int | None = None,
                 ports: range | None = None) -> None:
        """``daemon_home``: where the daemon keeps its guest images; a node that sees that
        folder (the daemon's own machine, a shared disk) uses them instead of building.
        ``capacity_mib``: guest RAM this host may commit, below its own RAM. ``ports``:
        the host ports its machines' URLs and incoming forks take (default: any free)."""
        from boxd.runtime.local import LocalRuntime

        self.name, self.node_id = name, node_id
        self.capacity_mib = capacity_mib
        self.home = Path(home)
        self.home.mkdir(parents=True, exist_ok=True)
        images = self.home / "images"
        shared = Path(daemon_home) / "images" if daemon_home else None
        if shared is not None and shared.is_dir() and not images.exists():
            images.symlink_to(shared.resolve(), target_is_directory=True)
        self.runtime = LocalRuntime(self.home, api_address=api_address, ports=ports)
        self._uploads: dict[str, tuple[asyncio.Queue, asyncio.Task]] = {}
        self._adopted = False
        self._adopting = asyncio.Lock()

    async def _adopt_all(self) -> None:
        """Before its first answer, an agent takes over the machines an earlier agent of
        this node left (Ray restarted it after a crash, or its worker was killed)."""
        async with self._adopting:  # calls that come meanwhile wait for it
            if self._adopted:
                return
            for vm_id in self.machine_ids():
                try:
                    await self.runtime.adopt(vm_id)
                except Exception as error:  # one machine's broken state must not stop the others
                    log.warning("host %s: cannot adopt %s: %s", self.name, vm_id, error)
            self._adopted = True

    def machine_ids(self) -> list[str]:
        vms = self.home / "vms"
        return sorted(path.name for path in vms.iterdir() if (path / "machine.json").exists()) if vms.exists() else []

    async def load(self) -> HostLoad:
        await self._adopt_all()
        total = _memory_mib("MemTotal")
        return HostLoad(host=self.name, node_id=self.node_id, available_mib=_memory_mib("MemAvailable"),
                        committed_mib=self.runtime.committed_memory_mib(),
                        total_mib=min(total, self.capacity_mib) if self.capacity_mib else total,
                        machines=len(self.machine_ids()))

    async def pid(self) -> int:
        return os.getpid()

    async def call(self, method: str, *args: Any, **kwargs: Any) -> Any:
        if method not in CALLS:
            raise InvalidInput(f"method: the host agent does not offer {method!r}", field="method")
        await self._adopt_all()
        # What starts a QEMU here needs the guest image here first.
        if method == "create":
            await self._ensure_image(args[1])
        elif method == "receive_capture":
            await self._ensure_image(args[0])
        answer = getattr(self.runtime, method)(*args, **kwargs)
        return await answer if inspect.isawaitable(answer) else answer

    async def _ensure_image(self, spec: VMSpec) -> None:
        from boxd.guest.image import ImageRecipe, ensure_image

        if (self.home / "images" / spec.image).exists():
            return
        built = await asyncio.to_thread(ensure_image, ImageRecipe(), home=self.home)
        if built.digest != spec.image:
            raise HostError(f"host {self.name} builds guest image {built.digest[:12]}, the daemon asked for "
                            f"{spec.image[:12]}: the hosts run different boxd versions")

    # -- streams ----------------------------------------------------------------------

    async def exec(self, vm_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        await self._adopt_all()
        async for event in self.runtime.exec(vm_id, request):
            yield event

    async def attach(self, vm_id: str, pid: int) -> AsyncIterator[ExecEvent]:
        await self._adopt_all()
        async for event in self.runtime.attach(vm_id, pid):
            yield event

    async def read_file(self, vm_id: str, path: str) -> AsyncIterator[bytes]:
        await self._adopt_all()
        async for chunk in self.runtime.read_file(vm_id, path):
            yield chunk

    async def watch(self, vm_id: str, path: str, recursive: bool) -> AsyncIterator[tuple[str, str]]:
        await self._adopt_all()
        async for change in self.runtime.watch(vm_id, path, recursive=recursive):
            yield change

    # -- snapshots across hosts -------------------------------------------------------

    async def snapshot_digests(self) -> list[str]:
        return snapshot_digests(self.runtime.snapshots_dir)

    async def snapshot_chunk(self, digest: str, name: str, offset: int, length: int) -> bytes:
        return await asyncio.to_thread(read_chunk, self.runtime.snapshots_dir, digest, name, offset, length)

    async def fetch_snapshot(self, digest: str, source: Any) -> int:
        """Copy a snapshot from the host agent ``source`` (an actor); returns bytes copied."""

        async def fetch(name: str, offset: int, length: int) -> bytes:
            return await source.snapshot_chunk.remote(digest, name, offset, length)

        return await receive_snapshot(self.runtime.snapshots_dir, digest, fetch)

    # -- disk layers across hosts -----------------------------------------------------

    async def layer_chunk(self, name: str, offset: int, length: int) -> bytes:
        return await asyncio.to_thread(self.runtime.export_chunk, name, offset, length)

    async def import_layer(self, capture_id: str, name: str, size: int, source: Any, image_digest: str) -> int:
        """Copy an exported disk layer from the host agent ``source`` unless this host has it,
        for the forks of ``capture_id`` (after ``receive_capture``, which brought the image)."""

        async def fetch(offset: int, length: int) -> bytes:
            return await source.layer_chunk.remote(name, offset, length)

        return await self.runtime.import_layer(capture_id, name, size, fetch, image_digest)

    # -- uploads ----------------------------------------------------------------------

    async def begin_upload(self, vm_id: str, path: str, mode: int | None, user: str) -> str:
        await self._adopt_all()
        queue: asyncio.Queue[bytes | None] = asyncio.Queue(maxsize=4)

        async def parts() -> AsyncIterator[bytes]:
            while (part := await queue.get()) is not None:
                yield part

        upload = secrets.token_hex(8)
        task = asyncio.create_task(self.runtime.write_file(vm_id, path, parts(), mode=mode, user=user))
        self._uploads[upload] = (queue, task)
        return upload

    async def upload_part(self, upload: str, data: bytes) -> None:
        queue, task = self._uploads[upload]
        if task.done():  # it failed: say why now rather than at the end
            await self.end_upload(upload)
        await queue.put(data)

    async def end_upload(self, upload: str) -> int:
        queue, task = self._uploads.pop(upload)
        if not task.done():
            await queue.put(None)
        return await task

    async def abort_upload(self, upload: str) -> None:
        entry = self._uploads.pop(upload, None)
        if entry is not None:
            entry[1].cancel()
