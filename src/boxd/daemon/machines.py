"""Machine lifecycle policy: what the daemon does between a route and the VM runtime.

A machine is recorded ``starting`` (the quota check and the name check happen in that
same transaction), then the runtime starts its QEMU, then a background task waits for
its agent and marks it ``running``, or ``failed`` with the reason. Commands and file
transfers on a machine that is still starting wait for it, up to ``ready_timeout_s``.
Machines outlive the daemon: a new daemon re-adopts each one the store says is alive.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import logging
import os
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

from boxd.config import MACHINE_KEY_PATH
from boxd.daemon.auth import Keys
from boxd.daemon.idle import Activity, IdlePolicy
from boxd.daemon.logs import event
from boxd.daemon.store import Store
from boxd.errors import BoxdError, Conflict, HostError, InvalidInput, NotFound, Timeout, VMError
from boxd.models import (
    Checkpoint,
    ExecBody,
    ExecEvent,
    ExecResult,
    Machine,
    MachineCreate,
    MachineFork,
    MachineState,
    SnapshotState,
)
from boxd.runtime.agent_client import ExecEvent as VMExecEvent
from boxd.runtime.interface import ExecRequest, Runtime, VMInfo, VMSpec, VMState

log = logging.getLogger(__name__)


class ClosableRuntime(Runtime, Protocol):
    async def close(self) -> None:
        """Let go of connections; the machines keep running."""


def _host_cores() -> int:
    return len(os.sched_getaffinity(0))


def _host_memory_mib() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") // (1024 * 1024)


@dataclass(frozen=True)
class Limits:
    max_vcpus: int = field(default_factory=_host_cores)
    # Half the host's RAM, so that one machine can never starve the host.
    max_memory_mib: int = field(default_factory=lambda: _host_memory_mib() // 2)
    max_upload_bytes: int = 2 * 1024**3
    # A boot is about a second under KVM, but under TCG twenty machines started at once on
    # two cores take minutes; a QEMU that dies is reported at once whatever this is.
    ready_timeout_s: float = 300.0


class ImageCache:
    """The guest image's digest, built (or found on disk) once, on the first create.

    Building takes about 90 s the first time, so it happens lazily and under a lock:
    concurrent first creates wait for one build instead of starting several.
    """

    def __init__(self, build: Callable[[], str]) -> None:
        self._build = build
        self._digest: str | None = None
        self._lock = asyncio.Lock()

    @classmethod
    def default(cls, home: Path) -> ImageCache:
        def build() -> str:
            from boxd.guest.image import ImageRecipe, ensure_image

            return ensure_image(ImageRecipe(), home=home).digest

        return cls(build)

    async def digest(self) -> str:
        async with self._lock:
            if self._digest is None:
                self._digest = await asyncio.to_thread(self._build)
            return self._digest


def new_machine_id() -> str:
    return f"m-{secrets.token_hex(6)}"


def reason_of(error: BaseException) -> str:
    return error.message if isinstance(error, BoxdError) else f"{type(error).__name__}: {error}"


def _exit_code(exit_code: int | None, signal: int | None) -> int:
    # The shell's convention, so that the CLI can exit with it: 128 + N for signal N.
    return exit_code if exit_code is not None else 128 + (signal or 0)


def _b64(data: bytes) -> str:
    return base64.b64encode(data).decode()


class MachineService:
    def __init__(
        self,
        store: Store,
        runtime: ClosableRuntime,
        *,
        images: ImageCache,
        limits: Limits,
        idle: IdlePolicy | None = None,
        keys: Keys | None = None,
    ) -> None:
        self._store = store
        # With keys, every machine that becomes ready gets one of its own for the SDK inside it.
        self._keys = keys
        self.runtime = runtime
        self._images = images
        self.limits = limits
        self.idle = idle or IdlePolicy()
        self.activity = Activity()
        self._becoming_ready: dict[str, asyncio.Task] = {}
        # Create and delete of one machine never overlap.
        self._lifecycle_locks: dict[str, asyncio.Lock] = {}
        self._idle_watch: asyncio.Task | None = None
        self._power_locks: dict[str, asyncio.Lock] = {}

    # -- startup and shutdown ---------------------------------------------------------

    async def recover(self) -> None:
        """Re-adopt every machine the store says is alive; a dead one becomes ``failed``."""
        for machine in self._store.machines_on_host():
            try:
                info = await self.runtime.adopt(machine.id)
            except BoxdError as error:
                self._fail(machine.id, f"lost while the daemon was down: {error.message}")
                continue
            if info.state is VMState.FAILED:
                self._fail(machine.id, "its process exited while the daemon was down")
            elif info.state is VMState.STOPPED:  # hibernated, perhaps with a wake cut short
                self._store.update_machine(machine.id, state=MachineState.STOPPED)
            elif machine.state is MachineState.STARTING:
                self._watch_readiness(machine.id)
            else:
                if machine.state.value != info.state.value:  # the runtime knows best
                    self._store.update_machine(machine.id, state=MachineState(info.state.value))
                if info.state is VMState.RUNNING:
                    # Its agent connects again, and so serves the API inside the machine again.
                    self._watch_readiness(machine.id)
            event(log, "machine.adopted", machine=machine.id, state=info.state.value, pid=info.pid)
        # What the previous daemon was doing when it died (a capture, a delete) may have
        # left files or a template process behind.
        await self.runtime.collect_garbage()

    async def close(self) -> None:
        """Stop watching and let go of the runtime; the machines keep running for the next daemon."""
        tasks = list(self._becoming_ready.values())
        if self._idle_watch is not None:
            tasks.append(self._idle_watch)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self.runtime.close()

    # -- lifecycle --------------------------------------------------------------------

    def _check_host_limits(self, request: MachineCreate) -> None:
        if request.vcpus > self.limits.max_vcpus:
            raise InvalidInput(
                f"vcpus: at most {self.limits.max_vcpus} (this host's cores), got {request.vcpus}", field="vcpus"
            )
        if request.memory_mib > self.limits.max_memory_mib:
            raise InvalidInput(
                f"memory_mib: at most {self.limits.max_memory_mib} (half this host's RAM), got {request.memory_mib}",
                field="memory_mib",
            )

    async def _check_host(self, host: str | None) -> None:
        if host is not None and host not in await self.runtime.hosts():
            raise NotFound(f"host: no live host {host}", field="host")

    def lifecycle_lock(self, machine_id: str) -> asyncio.Lock:
        return self._lifecycle_locks.setdefault(machine_id, asyncio.Lock())

    async def create(self, account: str, request: MachineCreate) -> Machine:
        snapshot = None
        if request.from_snapshot is not None:
            try:
                snapshot = self._store.find_snapshot(account, request.from_snapshot)
            except NotFound as error:
                raise NotFound(error.message, field="from_snapshot") from None
            if snapshot.state is not SnapshotState.READY:
                raise Conflict(f"snapshot {snapshot.ref} is {snapshot.state.value}", field="from_snapshot")
            # The machine is what the snapshot holds: its RAM size and devices come with it.
            request = request.model_copy(
                update={
                    "vcpus": snapshot.vcpus,
                    "memory_mib": snapshot.memory_mib,
                    "disk_gib": snapshot.disk_gib,
                    "isolated": snapshot.isolated,
                }
            )
        self._check_host_limits(request)
        await self._check_host(request.host)
        machine = self._store.add_machine(account, new_machine_id(), request)
        event(log, "machine.creating", machine=machine.id, account=account, name=machine.name,
              snapshot=snapshot.ref if snapshot else None)

        async def boot() -> VMInfo:
            image = await self._images.digest()
            self._store.update_machine(machine.id, image=image)
            spec = VMSpec(
                image=image,
                vcpus=request.vcpus,
                memory_mib=request.memory_mib,
                disk_gib=request.disk_gib,
                isolated=request.isolated,
                http_port=request.http_port,
            )
            return await self.runtime.create(
                machine.id, spec, snapshot=snapshot.digest if snapshot else None, host=request.host
            )

        return await self._bring_up(account, machine, boot, "machine.started")

    async def fork(self, account: str, ref: str, request: MachineFork) -> Machine:
        """A new machine continuing from this instant of a running one; counts against the quota."""
        source = await self.usable(account, ref)
        await self._check_host(request.host)
        # Its URL is its own and private until asked otherwise; the rest is its source's.
        copy = MachineCreate(
            name=request.name,
            vcpus=source.vcpus,
            memory_mib=source.memory_mib,
            disk_gib=source.disk_gib,
            isolated=source.isolated,
            suspend_after_s=source.suspend_after_s,
            hibernate_after_s=source.hibernate_after_s,
            http_port=source.http_port,
        )
        machine = self._store.add_machine(account, new_machine_id(), copy, parent=source.id, image=source.image)
        event(log, "machine.forking", machine=machine.id, source=source.id, account=account, name=machine.name)

        async def fork() -> VMInfo:
            (info,) = await self.runtime.fork(source.id, [machine.id], host=request.host)
            return info

        return await self._bring_up(account, machine, fork, "machine.forked")

    async def _bring_up(
        self, account: str, machine: Machine, start: Callable[[], Awaitable[VMInfo]], started: str
    ) -> Machine:
        """Start a recorded machine's VM under its lock: failed if that fails, else watched until ready."""
        async with self.lifecycle_lock(machine.id):
            try:
                info = await start()
            except (NotFound, Conflict) as error:
                # Refused before anything was made (a fork's source deleted or stopped meanwhile):
                # the request changes nothing, so no failed machine is left on record.
                self._store.mark_deleted(machine.id)
                event(log, "machine.refused", machine=machine.id, reason=reason_of(error))
                raise
            except BaseException as error:
                self._fail(machine.id, reason_of(error))
                raise
            if info.host is not None:
                self._store.update_machine(machine.id, host=info.host)
            event(log, started, machine=machine.id, pid=info.pid, accelerator=info.accelerator, host=info.host)
            self._watch_readiness(machine.id)
        return self._store.find_machine(account, machine.id)

    def _fail(self, machine_id: str, reason: str) -> Machine | None:
        failed = self._store.update_machine(machine_id, state=MachineState.FAILED, reason=reason)
        event(log, "machine.failed", level=logging.WARNING, machine=machine_id, reason=reason)
        return failed

    def _watch_readiness(self, machine_id: str) -> None:
        task = asyncio.create_task(self._become_ready(machine_id), name=f"ready-{machine_id}")
        self._becoming_ready[machine_id] = task
        task.add_done_callback(lambda _: self._becoming_ready.pop(machine_id, None))

    async def _become_ready(self, machine_id: str) -> None:
        started = time.monotonic()
        try:
            await self.runtime.wait_ready(machine_id, self.limits.ready_timeout_s)
        except asyncio.CancelledError:
            raise
        except Exception as error:
            self._fail(machine_id, reason_of(error))
            return
        if self._store.update_machine(machine_id, state=MachineState.RUNNING, only_from=MachineState.STARTING):
            # Idle from now on, not from the request: a first boot may wait minutes for the image.
            self.activity.touch(machine_id)
            event(log, "machine.ready", machine=machine_id, boot_s=round(time.monotonic() - started, 2))
            await self._hand_key(machine_id)

    async def _hand_key(self, machine_id: str) -> None:
        """Give the machine a key of its own account at MACHINE_KEY_PATH, for the SDK inside it.

        Every start (boot, fork, restore, wake) gets a new key and revokes the one before:
        a fork would otherwise carry its source's key, and a restore an older one.
        """
        if self._keys is None:
            return
        key = self._keys.mint(self._store.account_of(machine_id), "machine key", machine=machine_id).key

        async def content() -> AsyncIterator[bytes]:
            yield key.encode() + b"\n"

        try:
            await self.runtime.write_file(machine_id, str(MACHINE_KEY_PATH), content(), mode=0o644, user="root")
        except BoxdError as error:  # the machine works without it; only the SDK inside lacks a key
            event(log, "machine.key_not_written", level=logging.WARNING, machine=machine_id, reason=error.message)

    async def _refreshed(self, machine: Machine) -> Machine:
        """The machine, marked ``failed`` first if its process died behind our back."""
        if machine.state not in (MachineState.RUNNING, MachineState.PAUSED):
            return machine
        try:
            info = await self.runtime.info(machine.id)
        except NotFound:
            info = None
        except HostError:  # its host cannot be asked now; if it died, the lost watch says so
            return machine
        if info is None or info.state is VMState.FAILED:
            reason = "its process exited" + (f"; console log: {info.console_log}" if info else "")
            return self._fail(machine.id, reason) or machine
        return machine

    def state_of(self, account: str, ref: str) -> MachineState:
        """As the store has it, without asking the runtime or counting as a use."""
        return self._store.find_machine(account, ref).state

    async def get(self, account: str, ref: str) -> Machine:
        machine = await self._refreshed(self._store.find_machine(account, ref))
        self.activity.touch(machine.id)
        return machine

    async def list(self, account: str) -> list[Machine]:
        return [await self._refreshed(machine) for machine in self._store.list_machines(account)]

    async def delete(self, account: str, ref: str) -> Machine:
        machine_id = self._store.find_machine(account, ref).id
        async with self.lifecycle_lock(machine_id):
            # Found again under the lock: a concurrent delete may have won.
            machine = self._store.find_machine(account, machine_id)
            task = self._becoming_ready.pop(machine_id, None)
            if task is not None:
                task.cancel()
            if machine.state is not MachineState.LOST:  # a lost one went with its host
                with contextlib.suppress(NotFound):  # the runtime has nothing left of it
                    await self.runtime.delete(machine_id)
            deleted = self._store.mark_deleted(machine.id)
        self._lifecycle_locks.pop(machine_id, None)
        self._power_locks.pop(machine_id, None)
        self.activity.forget(machine_id)
        event(log, "machine.deleted", machine=machine_id, account=account)
        return deleted

    async def wait_ready(self, account: str, ref: str, timeout: float) -> Machine:
        deadline = time.monotonic() + timeout
        machine = self._store.find_machine(account, ref)
        while machine.state is MachineState.STARTING and (remaining := deadline - time.monotonic()) > 0:
            task = self._becoming_ready.get(machine.id)
            if task is not None:
                await asyncio.wait({task}, timeout=remaining)
            else:  # its create request is still starting the VM
                await asyncio.sleep(min(0.05, remaining))
            machine = self._store.find_machine(account, machine.id)
        machine = await self._refreshed(machine)
        if machine.state is MachineState.STARTING:
            raise Timeout(f"machine {machine.name} is not ready after {timeout:g} s", machine=machine.id)
        if machine.state is not MachineState.RUNNING:
            raise Conflict(
                f"machine {machine.name} is {machine.state.value}" + (f": {machine.reason}" if machine.reason else ""),
                machine=machine.id,
                state=machine.state.value,
            )
        return machine

    async def usable(self, account: str, ref: str, timeout: float | None = None) -> Machine:
        """A running machine to work in: woken if it is suspended or hibernated (or
        being put to sleep right now), waited for if it is still starting (up to
        ``timeout``, by default the daemon's readiness deadline)."""
        machine = self._store.find_machine(account, ref)
        self.activity.touch(machine.id)
        async with self._power_lock(machine.id):
            await self._wake(self._store.find_machine(account, machine.id))
        machine = await self.wait_ready(account, machine.id, timeout or self.limits.ready_timeout_s)
        self.activity.touch(machine.id)
        return machine

    # -- idle machines ----------------------------------------------------------------
    #
    # Suspending, hibernating and waking one machine take its power lock, then its
    # lifecycle lock: a use that comes while the machine is being put to sleep waits,
    # then wakes it; an idle pass looks again under the lock before it acts.

    def _power_lock(self, machine_id: str) -> asyncio.Lock:
        return self._power_locks.setdefault(machine_id, asyncio.Lock())

    async def suspend(self, account: str, ref: str) -> Machine:
        """Stop a running machine's vCPUs; its memory stays, and any use wakes it."""
        machine = self._store.find_machine(account, ref)
        if machine.state is not MachineState.PAUSED:
            machine = await self.wait_ready(account, ref, self.limits.ready_timeout_s)
            async with self._power_lock(machine.id):
                await self._sleep(self._store.find_machine(account, machine.id), MachineState.PAUSED)
        return self._store.find_machine(account, machine.id)

    async def hibernate(self, account: str, ref: str, *, keep_memory: bool = True) -> Machine:
        """Save a machine's whole state to disk and end its process; it stops counting
        against the quota, and any use wakes it (if the quota allows). Without
        ``keep_memory`` only its disk is kept: it wakes by booting, its processes gone."""
        machine = self._store.find_machine(account, ref)
        if machine.state not in (MachineState.RUNNING, MachineState.PAUSED, MachineState.STOPPED):
            machine = await self.wait_ready(account, ref, self.limits.ready_timeout_s)
        async with self._power_lock(machine.id):
            await self._sleep(self._store.find_machine(account, machine.id), MachineState.STOPPED,
                              keep_memory=keep_memory)
        return self._store.find_machine(account, machine.id)

    async def resume(self, account: str, ref: str) -> Machine:
        """Run a suspended machine again, or bring back a hibernated one (quota permitting)."""
        machine = self._store.find_machine(account, ref)
        async with self._power_lock(machine.id):
            await self._wake(self._store.find_machine(account, machine.id))
        self.activity.touch(machine.id)
        return self._store.find_machine(account, machine.id)

    async def _sleep(self, machine: Machine, state: MachineState, *, keep_memory: bool = True) -> None:
        """Suspend (PAUSED) or hibernate (STOPPED) a machine; the caller holds its power lock."""
        if machine.state is state:
            return
        async with self.lifecycle_lock(machine.id):
            started = time.monotonic()
            if state is MachineState.PAUSED:
                await self.runtime.suspend(machine.id)
            else:
                await self.runtime.hibernate(machine.id, keep_memory=keep_memory)
            self._store.update_machine(machine.id, state=state)
        event(log, "machine.suspended" if state is MachineState.PAUSED else "machine.hibernated",
              machine=machine.id, seconds=round(time.monotonic() - started, 3))

    async def _wake(self, machine: Machine) -> None:
        """Wake a suspended or hibernated machine; the caller holds its power lock."""
        if machine.state not in (MachineState.PAUSED, MachineState.STOPPED):
            return
        async with self.lifecycle_lock(machine.id):
            if machine.state is MachineState.PAUSED:
                started = time.perf_counter()
                await self.runtime.resume(machine.id)
                woke_ms = (time.perf_counter() - started) * 1000
                self._store.update_machine(machine.id, state=MachineState.RUNNING, only_from=MachineState.PAUSED)
                event(log, "machine.resumed", machine=machine.id, ms=round(woke_ms, 3))
                return
            self._store.wake_machine(machine.id)  # QuotaExceeded leaves it hibernated
            try:
                await self.runtime.resume(machine.id)
            except BaseException as error:
                self._fail(machine.id, f"waking from hibernation failed: {reason_of(error)}")
                raise
            event(log, "machine.woke", machine=machine.id)
            self._watch_readiness(machine.id)

    def start_idle_watch(self) -> None:
        self._idle_watch = asyncio.create_task(self._watch_idle(), name="idle-machines")

    async def _watch_idle(self) -> None:
        while True:
            await asyncio.sleep(self.idle.check_every_s)
            await self.mark_lost()
            await self.enforce_idle_policy()

    async def mark_lost(self) -> None:
        """Machines whose host died become ``lost``: on record, out of the quota."""
        lost = set(await self.runtime.lost())
        if not lost:  # every tick of the idle watch asks: spare the store the read
            return
        for machine in self._store.machines_on_host():
            if machine.id in lost:
                self._store.update_machine(machine.id, state=MachineState.LOST,
                                           reason=f"its host {machine.host or '?'} is gone")
                self.activity.forget(machine.id)
                event(log, "machine.lost", level=logging.WARNING, machine=machine.id, host=machine.host)

    async def enforce_idle_policy(self) -> None:
        """One pass: suspend or hibernate every machine idle for long enough."""
        for machine in self._store.machines_on_host():
            if self.idle.step_due(machine, self.activity.idle_for(machine.id)) is None:
                continue
            power = self._power_lock(machine.id)
            if power.locked() or self.lifecycle_lock(machine.id).locked():
                continue  # in use right now: not idle
            async with power:
                # Looked at again under the lock: a use may have come meanwhile.
                try:
                    machine = self._store.find_machine(self._store.account_of(machine.id), machine.id)
                except NotFound:  # deleted meanwhile
                    continue
                due = self.idle.step_due(machine, self.activity.idle_for(machine.id))
                if due is None:
                    continue
                try:
                    await self._sleep(machine, due)
                except BoxdError as error:  # it changed meanwhile (failed): the next pass sees it
                    event(log, "machine.idle_step_failed", level=logging.WARNING, machine=machine.id,
                          step=due.value, reason=error.message)

    # -- checkpoints ------------------------------------------------------------------

    async def save_checkpoint(self, account: str, ref: str, name: str) -> Checkpoint:
        machine = await self.usable(account, ref)
        if any(existing.name == name for existing in self._store.list_checkpoints(machine.id)):
            raise Conflict(f"machine {machine.name} has a checkpoint named {name} already", field="name")
        taken = await self.runtime.checkpoint(machine.id)
        try:
            saved = self._store.add_checkpoint(machine.id, name, taken.id, round(taken.pause_s * 1000, 1))
        except BoxdError:  # a concurrent save took the name first
            await self.runtime.drop_checkpoint(machine.id, taken.id)
            raise
        event(log, "checkpoint.saved", machine=machine.id, name=name, pause_ms=saved.pause_ms)
        return saved

    async def list_checkpoints(self, account: str, ref: str) -> list[Checkpoint]:
        return self._store.list_checkpoints(self._store.find_machine(account, ref).id)

    async def restore_checkpoint(self, account: str, ref: str, name: str) -> Machine:
        """Rewind the machine in place; returns once it runs again, with its name and id."""
        machine = await self._refreshed(self._store.find_machine(account, ref))
        capture = self._store.checkpoint_capture(machine.id, name)
        if machine.state is not MachineState.RUNNING:
            # A failed machine no longer counts against the quota: bringing it back here
            # would get round it. Its snapshots can start a new machine.
            raise Conflict(f"machine {machine.name} is {machine.state.value}, so it cannot be restored", field="machine")
        async with self.lifecycle_lock(machine.id):
            started = time.monotonic()
            try:
                await self.runtime.restore(machine.id, capture)
                await self.runtime.wait_ready(machine.id, self.limits.ready_timeout_s)
            except BoxdError as error:
                self._fail(machine.id, f"restoring checkpoint {name} failed: {error.message}")
                raise
            self._store.update_machine(machine.id, state=MachineState.RUNNING)
            await self._hand_key(machine.id)
        event(log, "checkpoint.restored", machine=machine.id, name=name, seconds=round(time.monotonic() - started, 3))
        return self._store.find_machine(account, machine.id)

    async def delete_checkpoint(self, account: str, ref: str, name: str) -> None:
        machine = self._store.find_machine(account, ref)
        capture = self._store.checkpoint_capture(machine.id, name)
        async with self.lifecycle_lock(machine.id):
            with contextlib.suppress(NotFound):  # gone from the runtime already
                await self.runtime.drop_checkpoint(machine.id, capture)
            self._store.delete_checkpoint(machine.id, name)
        event(log, "checkpoint.deleted", machine=machine.id, name=name)

    # -- inside the machine -----------------------------------------------------------

    async def exec_stream(self, account: str, ref: str, body: ExecBody) -> AsyncIterator[ExecEvent]:
        request = ExecRequest(
            argv=body.argv,
            shell=body.cmd,
            env=body.env,
            cwd=body.cwd,
            user=body.user,
            stdin=None if body.stdin_b64 is None else base64.b64decode(body.stdin_b64),
            timeout=body.timeout,
        )
        async for item in self.run_process(account, ref, request):
            if item.kind == "exit":
                yield ExecEvent(
                    type="exit", exit_code=_exit_code(item.exit_code, item.signal), timed_out=item.timed_out
                )
            elif item.kind == "started":
                yield ExecEvent(type="started", pid=item.pid)
            else:
                yield ExecEvent(type=item.kind, data_b64=_b64(item.data))

    async def run_process(self, account: str, ref: str, request: ExecRequest) -> AsyncIterator[VMExecEvent]:
        """A command's events as the runtime gives them (pty output and all); leaving early
        leaves the command running, to be followed again with ``follow_process``."""
        machine = await self.usable(account, ref)
        event(log, "machine.exec", machine=machine.id, argv=request.argv, shell=request.shell, user=request.user)
        with self.activity.busy(machine.id):
            async for item in self.runtime.exec(machine.id, request):
                yield item

    async def follow_process(self, account: str, ref: str, pid: int) -> AsyncIterator[VMExecEvent]:
        machine = await self.usable(account, ref)
        with self.activity.busy(machine.id):
            async for item in self.runtime.attach(machine.id, pid):
                yield item

    async def process_op(self, account: str, ref: str, op: str, **fields: Any) -> dict[str, Any]:
        machine = await self.usable(account, ref)
        with self.activity.busy(machine.id):
            return await self.runtime.process(machine.id, op, **fields)

    async def fs_op(self, account: str, ref: str, op: str, **fields: Any) -> dict[str, Any]:
        machine = await self.usable(account, ref)
        with self.activity.busy(machine.id):
            return await self.runtime.fs(machine.id, op, **fields)

    async def watch_dir(self, account: str, ref: str, path: str, *, recursive: bool) -> AsyncIterator[tuple[str, str]]:
        machine = await self.usable(account, ref)
        async for change in self.runtime.watch(machine.id, path, recursive=recursive):
            yield change

    async def exec(self, account: str, ref: str, body: ExecBody) -> ExecResult:
        started = time.monotonic()
        output: dict[str, list[bytes]] = {"stdout": [], "stderr": []}
        async for item in self.exec_stream(account, ref, body):
            if item.type in output:
                output[item.type].append(item.data)
            elif item.type == "exit":
                return ExecResult(
                    stdout_b64=_b64(b"".join(output["stdout"])),
                    stderr_b64=_b64(b"".join(output["stderr"])),
                    exit_code=item.exit_code,
                    timed_out=item.timed_out,
                    duration_s=round(time.monotonic() - started, 3),
                )
        raise VMError(f"machine {ref}: the command's output ended without an exit status")

    async def write_file(
        self, account: str, ref: str, path: str, chunks: AsyncIterator[bytes], *, mode: int | None, user: str
    ) -> int:
        machine = await self.usable(account, ref)
        with self.activity.busy(machine.id):
            size = await self.runtime.write_file(machine.id, path, chunks, mode=mode, user=user)
        event(log, "machine.file_written", machine=machine.id, path=path, size=size)
        return size

    async def read_file(self, account: str, ref: str, path: str) -> AsyncIterator[bytes]:
        machine = await self.usable(account, ref)
        event(log, "machine.file_read", machine=machine.id, path=path)
        with self.activity.busy(machine.id):
            async for chunk in self.runtime.read_file(machine.id, path):
                yield chunk
