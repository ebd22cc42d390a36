"""Test doubles for the control plane: a runtime without VMs, and a daemon to run it in.

``FakeRuntime`` keeps to the ``Runtime`` protocol but runs commands as host processes
(unit tests only: nothing is isolated) and keeps files in a dict. Its machines live in a
``FakeHost`` that can outlive one runtime, the way QEMU processes outlive a daemon; so do
its snapshots, the way snapshot folders outlive one. A checkpoint is a copy of a
machine's files, and a snapshot a copy named by the SHA-256 of what it holds.

A suspended or hibernated fake VM refuses commands, files, forks and checkpoints, as a
real one whose vCPUs are stopped or whose process is gone cannot serve them: a test
passes only if the daemon wakes the machine first. Its files survive hibernation.
"""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import signal
import threading
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boxd.daemon.idle import IdlePolicy
from boxd.daemon.machines import ImageCache, Limits
from boxd.daemon.server import Daemon
from boxd.daemon.snapshots import SnapshotService
from boxd.errors import AgentUnavailable, BoxdError, Conflict, InvalidInput, NotFound, Timeout, VMError
from boxd.runtime.agent_client import ExecEvent
from boxd.runtime.interface import CheckpointTaken, ExecRequest, VMInfo, VMSpec, VMState
from boxd.runtime.snapshots import Progress, SnapshotManifest

FAKE_IMAGE = "0" * 64


@dataclass
class FakeVM:
    spec: VMSpec
    url_port: int  # where on the host's 127.0.0.1 its URL leads
    alive: bool = True  # False: its process died behind the daemon's back
    suspended: bool = False
    hibernated: bool = False  # no process; files kept, as on a real machine's disk
    memory_kept: bool = True  # by its hibernation: without it, waking is a new boot
    boots: int = 1
    files: dict[str, bytes] = field(default_factory=dict)
    # Checkpoint id -> the files at its instant; they go when the machine does.
    checkpoints: dict[str, dict[str, bytes]] = field(default_factory=dict)

    @property
    def state(self) -> VMState:
        if self.hibernated:
            return VMState.STOPPED
        if not self.alive:
            return VMState.FAILED
        return VMState.PAUSED if self.suspended else VMState.RUNNING


@dataclass(frozen=True)
class FakeSnapshot:
    spec: VMSpec
    files: dict[str, bytes]


@dataclass
class FakeHost:
    vms: dict[str, FakeVM] = field(default_factory=dict)
    snapshots: dict[str, FakeSnapshot] = field(default_factory=dict)  # by digest

    def kill(self, vm_id: str) -> None:
        """The VM's process dies behind the daemon's back."""
        self.vms[vm_id].alive = False


class FakeRuntime:
    def __init__(
        self,
        host: FakeHost | None = None,
        *,
        ready_after: float = 0.0,
        fail_create: Exception | None = None,
        fail_ready: Exception | None = None,
        fail_snapshot: Exception | None = None,
        snapshot_s: float = 0.0,
        url_port: int | None = None,
    ) -> None:
        self.host = host or FakeHost()
        self.ready_after = ready_after
        self.fail_create = fail_create
        self.fail_ready = fail_ready
        self.fail_snapshot = fail_snapshot
        self.snapshot_s = snapshot_s  # how long writing a snapshot takes, half done half way
        # The host port every new VM's URL leads to (a test's HTTP server); by default its
        # http_port itself, since the fake's "guest" is the host.
        self.url_port = url_port
        self.adopted: set[str] = set()
        self.closed = False
        self.collected = 0  # garbage collections asked for

    def _vm(self, vm_id: str) -> FakeVM:
        vm = self.host.vms.get(vm_id)
        if vm is None:
            raise NotFound(f"machine {vm_id}: not known to this runtime")
        return vm

    def _running(self, vm_id: str, what: str, error: type[BoxdError] = Conflict) -> FakeVM:
        """The VM if it runs: a suspended, hibernated or dead one cannot do ``what``."""
        vm = self._vm(vm_id)
        if vm.state is not VMState.RUNNING:
            raise error(f"machine {vm_id}: {vm.state.value}, so it cannot be {what}")
        return vm

    def _agent_of(self, vm_id: str) -> FakeVM:
        # A real agent does not answer while its vCPUs are stopped or its process is gone.
        return self._running(vm_id, "reached by its agent", AgentUnavailable)

    def _new_vm(self, spec: VMSpec, files: dict[str, bytes]) -> FakeVM:
        url_port = spec.http_port if self.url_port is None else self.url_port
        return FakeVM(spec, url_port=url_port, files=files)

    def _info(self, vm_id: str) -> VMInfo:
        vm = self._vm(vm_id)
        has_process = vm.state in (VMState.RUNNING, VMState.PAUSED)
        return VMInfo(
            vm_id, vm.state, pid=os.getpid() if has_process else None, accelerator="fake", console_log="/dev/null",
            url_port=None if vm.hibernated else vm.url_port,
        )

    async def create(
        self, vm_id: str, spec: VMSpec, *, snapshot: str | None = None, host: str | None = None
    ) -> VMInfo:
        if self.fail_create is not None:
            raise self.fail_create
        if vm_id in self.host.vms:
            raise Conflict(f"machine {vm_id}: already exists", field="id")
        files: dict[str, bytes] = {}
        if snapshot is not None:
            saved = self.host.snapshots.get(snapshot)
            if saved is None:
                raise NotFound(f"snapshot {snapshot[:12]}: no such snapshot on this host", field="snapshot")
            # The real runtime refuses this too: the snapshot's RAM is of one size.
            if saved.spec.memory_mib != spec.memory_mib:
                raise InvalidInput(
                    f"memory_mib: snapshot {snapshot[:12]} holds {saved.spec.memory_mib} MiB of RAM, "
                    f"not {spec.memory_mib}",
                    field="memory_mib",
                )
            files = dict(saved.files)
        self.host.vms[vm_id] = self._new_vm(spec, files)
        return self._info(vm_id)

    async def fork(self, source_id: str, new_ids: list[str], *, host: str | None = None) -> list[VMInfo]:
        source = self._running(source_id, "forked")
        for new_id in new_ids:
            self.host.vms[new_id] = self._new_vm(source.spec, dict(source.files))
        return [self._info(new_id) for new_id in new_ids]

    async def collect_garbage(self) -> None:
        self.collected += 1

    def _checkpoint_files(self, vm_id: str, checkpoint_id: str) -> dict[str, bytes]:
        files = self._vm(vm_id).checkpoints.get(checkpoint_id)
        if files is None:
            raise NotFound(f"machine {vm_id}: no checkpoint {checkpoint_id}", field="checkpoint")
        return files

    async def checkpoint(self, vm_id: str) -> CheckpointTaken:
        vm = self._running(vm_id, "checkpointed")
        checkpoint_id = f"ckpt-{os.urandom(4).hex()}"
        vm.checkpoints[checkpoint_id] = dict(vm.files)
        return CheckpointTaken(checkpoint_id, pause_s=0.001)

    async def restore(self, vm_id: str, checkpoint_id: str) -> VMInfo:
        vm = self._vm(vm_id)
        # A copy again: the same checkpoint can be restored again and again.
        vm.files = dict(self._checkpoint_files(vm_id, checkpoint_id))
        vm.alive, vm.suspended = True, False  # a new process, whatever became of the old one
        return self._info(vm_id)

    async def drop_checkpoint(self, vm_id: str, checkpoint_id: str) -> None:
        self._checkpoint_files(vm_id, checkpoint_id)
        del self._vm(vm_id).checkpoints[checkpoint_id]

    async def save_snapshot(self, vm_id: str, checkpoint_id: str, progress: Progress | None = None) -> SnapshotManifest:
        spec = self._vm(vm_id).spec
        files = dict(self._checkpoint_files(vm_id, checkpoint_id))
        total = sum(len(data) for data in files.values())
        if progress is not None:
            progress(total // 2, total)
        await asyncio.sleep(self.snapshot_s)
        if self.fail_snapshot is not None:
            raise self.fail_snapshot
        # Named by its content, as a real one: the same files and spec give the same digest.
        manifest = {
            **spec.to_dict(),
            "files": {path: {"sha256": hashlib.sha256(data).hexdigest(), "size": len(data)}
                      for path, data in files.items()},
        }
        digest = hashlib.sha256(json.dumps(manifest, sort_keys=True).encode()).hexdigest()
        self.host.snapshots[digest] = FakeSnapshot(spec, files)
        if progress is not None:
            progress(total, total)
        return SnapshotManifest(digest, manifest)

    async def delete_snapshot(self, digest: str) -> None:
        self.host.snapshots.pop(digest, None)

    async def adopt(self, vm_id: str) -> VMInfo:
        info = self._info(vm_id)
        self.adopted.add(vm_id)
        return info

    async def info(self, vm_id: str) -> VMInfo:
        return self._info(vm_id)

    async def wait_ready(self, vm_id: str, timeout: float) -> None:
        vm = self._vm(vm_id)
        if vm.state in (VMState.STOPPED, VMState.FAILED):  # no process to become ready
            raise VMError(f"machine {vm_id}: {vm.state.value}, it has no process to become ready")
        if self.ready_after > timeout:
            await asyncio.sleep(timeout)
            raise Timeout(f"machine {vm_id}: not ready after {timeout:.0f} s")
        await asyncio.sleep(self.ready_after)
        if self.fail_ready is not None:
            raise self.fail_ready

    async def exec(self, vm_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]:
        self._agent_of(vm_id)
        if request.argv is not None:
            process = await asyncio.create_subprocess_exec(
                *request.argv, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={**os.environ, **request.env}, cwd=request.cwd,
                start_new_session=True,
            )
        else:
            process = await asyncio.create_subprocess_shell(
                request.shell, stdin=asyncio.subprocess.PIPE, stdout=asyncio.subprocess.PIPE,
                stderr=asyncio.subprocess.PIPE, env={**os.environ, **request.env}, cwd=request.cwd,
                start_new_session=True,
            )
        yield ExecEvent("started", pid=process.pid)
        process.stdin.write(request.stdin or b"")
        process.stdin.close()
        queue: asyncio.Queue[ExecEvent | None] = asyncio.Queue()

        async def pump(kind: str, stream: asyncio.StreamReader) -> None:
            while chunk := await stream.read(65536):
                await queue.put(ExecEvent(kind, data=chunk))
            await queue.put(None)

        pumps = [asyncio.create_task(pump(kind, getattr(process, kind))) for kind in ("stdout", "stderr")]
        deadline = None if request.timeout is None else time.monotonic() + request.timeout
        finished, timed_out = 0, False
        while finished < 2:
            remaining = None if deadline is None else max(0.0, deadline - time.monotonic())
            try:
                item = await asyncio.wait_for(queue.get(), remaining)
            except TimeoutError:
                os.killpg(process.pid, signal.SIGKILL)  # the shell and what it started
                timed_out = True
                deadline = None
                continue
            if item is None:
                finished += 1
            else:
                yield item
        await asyncio.gather(*pumps)
        code = await process.wait()
        if code < 0:
            yield ExecEvent("exit", signal=-code, timed_out=timed_out)
        else:
            yield ExecEvent("exit", exit_code=code, timed_out=timed_out)

    async def write_file(
        self, vm_id: str, path: str, chunks: AsyncIterator[bytes], *, mode: int | None, user: str | None
    ) -> int:
        vm = self._agent_of(vm_id)
        data = b"".join([chunk async for chunk in chunks])
        vm.files[path] = data  # whole or not at all, like the agent
        return len(data)

    async def read_file(self, vm_id: str, path: str) -> AsyncIterator[bytes]:
        vm = self._agent_of(vm_id)
        if path not in vm.files:
            raise NotFound(f"path: no such file {path}")
        data = vm.files[path]
        for start in range(0, len(data), 65536):
            yield data[start : start + 65536]

    async def fs(self, vm_id: str, op: str, **fields: Any) -> dict[str, Any]:
        raise NotImplementedError(op)

    async def attach(self, vm_id: str, pid: int) -> AsyncIterator[ExecEvent]:
        raise NotImplementedError("attach")
        yield  # an async generator, like the real one

    async def process(self, vm_id: str, op: str, **fields: Any) -> dict[str, Any]:
        raise NotImplementedError(op)

    async def hosts(self) -> list[str]:
        return []

    async def lost(self) -> list[str]:
        return []

    async def watch(self, vm_id: str, path: str, *, recursive: bool = False) -> AsyncIterator[tuple[str, str]]:
        raise NotImplementedError("watch")
        yield  # an async generator, like the real one

    async def delete(self, vm_id: str) -> None:
        self._vm(vm_id)
        del self.host.vms[vm_id]

    async def suspend(self, vm_id: str) -> None:
        vm = self._vm(vm_id)
        if not vm.suspended:  # suspending twice is fine, as with the real runtime
            self._running(vm_id, "suspended").suspended = True

    async def hibernate(self, vm_id: str, *, keep_memory: bool = True) -> None:
        vm = self._vm(vm_id)
        if vm.state not in (VMState.RUNNING, VMState.PAUSED):
            raise Conflict(f"machine {vm_id}: {vm.state.value}, so it cannot be hibernated")
        vm.hibernated, vm.suspended, vm.memory_kept = True, False, keep_memory

    async def resume(self, vm_id: str) -> None:
        vm = self._vm(vm_id)
        if vm.hibernated:
            vm.hibernated, vm.alive = False, True  # a new process, from the saved state
            if not vm.memory_kept:
                vm.boots += 1
        vm.suspended = False

    async def close(self) -> None:
        self.closed = True


def fake_images() -> ImageCache:
    return ImageCache(lambda: FAKE_IMAGE)


@contextmanager
def daemon_thread(home: Path, runtime: FakeRuntime | None = None, *, limits: Limits | None = None) -> Iterator[Daemon]:
    """A real daemon (uvicorn on TCP and on its unix socket) serving a FakeRuntime."""
    daemon = Daemon(home, port=0, runtime=runtime or FakeRuntime(), images=fake_images(), limits=limits)
    errors: list[BaseException] = []

    def serve() -> None:
        try:
            asyncio.run(daemon.serve())
        except BaseException as error:  # shown by the test that waited for the daemon
            errors.append(error)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    deadline = time.monotonic() + 10
    while not daemon.started:
        if errors or time.monotonic() > deadline:
            raise RuntimeError(f"the test daemon did not start: {errors}")
        time.sleep(0.01)
    try:
        yield daemon
    finally:
        daemon.stop()
        thread.join(10)


class ControlPlane:
    """The daemon's app over its real store in a temp home, served in process via ASGI.

    ``http(key)`` talks to it as over TCP; ``http(local=True)`` as over the unix socket,
    which is where admin calls are allowed.
    """

    TCP_URL = "http://127.0.0.1:7345"

    def __init__(
        self,
        home: Path,
        runtime: FakeRuntime | None = None,
        *,
        limits: Limits | None = None,
        idle: IdlePolicy | None = None,
        url_format: str | None = None,
    ) -> None:
        from boxd.daemon import local_key_path, socket_path
        from boxd.daemon.app import create_app
        from boxd.daemon.auth import Keys
        from boxd.daemon.machines import MachineService
        from boxd.daemon.store import Store

        self.home = home
        self.limits = limits or Limits()
        self.idle = idle
        self.store = Store(home / "boxd.db")
        self.store.url_format = url_format  # what the daemon sets once it listens
        self.keys = Keys(self.store)
        self.keys.ensure_local_key(local_key_path(home))
        self.runtime = runtime or FakeRuntime()
        self.machines = MachineService(
            self.store, self.runtime, images=fake_images(), limits=self.limits, idle=self.idle
        )
        self.socket = str(socket_path(home))
        self.app = create_app(store=self.store, keys=self.keys, machines=self.machines, local_socket=self.socket)

    def key_for(self, account: str, max_machines: int | None = None) -> str:
        self.store.set_account(account, max_machines)
        return self.keys.mint(account).key

    def _local_app(self, scope: dict, receive: Any, send: Any) -> Any:
        # What uvicorn reports for a connection on the unix socket.
        return self.app({**scope, "server": (self.socket, None)}, receive, send)

    def transport(self, *, local: bool = False) -> Any:
        import httpx

        return httpx.ASGITransport(app=self._local_app if local else self.app)

    def http(self, key: str | None = None, *, local: bool = False) -> Any:
        import httpx

        headers = {"authorization": f"Bearer {key}"} if key else {}
        return httpx.AsyncClient(transport=self.transport(local=local), base_url=self.TCP_URL, headers=headers)

    @property
    def snapshots(self) -> SnapshotService:
        return self.app.state.snapshots

    async def restarted(self, runtime: FakeRuntime | None = None) -> ControlPlane:
        """A new daemon over the same files, after this one stopped; it re-adopts machines."""
        await self.close()
        plane = ControlPlane(
            self.home,
            runtime or FakeRuntime(self.runtime.host, url_port=self.runtime.url_port),
            limits=self.limits,
            idle=self.idle,
            url_format=self.store.url_format,
        )
        # What the app's lifespan does; ASGITransport does not run it.
        await plane.machines.recover()
        await plane.snapshots.recover()
        return plane

    async def close(self) -> None:
        await self.snapshots.close()
        await self.machines.close()
        self.store.close()


def short_home() -> Iterator[Path]:
    """A BOXD_HOME with a short path: a unix socket path must fit in 107 bytes."""
    import shutil
    import tempfile

    home = Path(tempfile.mkdtemp(prefix="boxd-", dir="/tmp"))
    try:
        yield home
    finally:
        shutil.rmtree(home, ignore_errors=True)
