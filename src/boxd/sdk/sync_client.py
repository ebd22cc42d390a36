"""``Boxd``: the synchronous face of ``AsyncBoxd``.

Each method here forwards to its async twin and nothing else; ``_mirrors`` checks at
import time that both take the same parameters, and gives both the same docstring, so
the faces cannot drift apart. The async code runs on an event loop in a thread of its
own (a ``Portal``), which every calling thread shares: the seed's ``ThreadPoolExecutor``
of rollouts then uses one connection pool, and the SDK works where a loop is already
running (a notebook).
"""

from __future__ import annotations

import asyncio
import inspect
import os
import threading
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import TypeVar

import httpx

from boxd.models import (
    Account,
    ApiKey,
    Checkpoint,
    CreatedKey,
    ExecEvent,
    ExecResult,
    FileWritten,
    Health,
    Machine,
    Snapshot,
)
from boxd.sdk.async_client import (
    DEFAULT_TIMEOUT,
    AsyncAdmin,
    AsyncBoxd,
    AsyncCheckpoints,
    AsyncFiles,
    AsyncMachines,
    AsyncSnapshots,
    Content,
    MachineRef,
)
from boxd.sdk.connection import resolve_endpoint

T = TypeVar("T")
F = TypeVar("F", bound=Callable)


def _mirrors(original: Callable) -> Callable[[F], F]:
    def check(method: F) -> F:
        ours = list(inspect.signature(method).parameters.values())
        theirs = list(inspect.signature(original).parameters.values())
        if ours != theirs:
            raise TypeError(f"{method.__qualname__} does not take the parameters of {original.__qualname__}")
        method.__doc__ = original.__doc__
        return method

    return check


class Portal:
    """Runs an ``AsyncBoxd`` on a private event loop for callers in any thread.

    A child made by ``os.fork`` (multiprocessing) gets a new loop and a new client of
    its own, since the parent's thread and connections do not come along.
    """

    def __init__(self, make_client: Callable[[], AsyncBoxd]) -> None:
        self._make_client = make_client
        self._lock = threading.Lock()
        self._pid: int | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: AsyncBoxd | None = None

    def _running(self) -> tuple[asyncio.AbstractEventLoop, AsyncBoxd]:
        with self._lock:
            if self._pid != os.getpid():
                loop = asyncio.new_event_loop()
                thread = threading.Thread(target=loop.run_forever, name="boxd-sdk", daemon=True)
                thread.start()
                self._loop, self._thread, self._client = loop, thread, self._make_client()
                self._pid = os.getpid()
            assert self._loop is not None and self._client is not None
            return self._loop, self._client

    @staticmethod
    def _wait(loop: asyncio.AbstractEventLoop, awaitable: Awaitable[T]) -> T:
        async def awaited() -> T:  # anext() and aclose() give awaitables, not coroutines
            return await awaitable

        future = asyncio.run_coroutine_threadsafe(awaited(), loop)
        try:
            return future.result()
        except BaseException:
            future.cancel()  # e.g. KeyboardInterrupt: do not leave the request running
            raise

    def call(self, use: Callable[[AsyncBoxd], Awaitable[T]]) -> T:
        loop, client = self._running()
        return self._wait(loop, use(client))

    def iterate(self, use: Callable[[AsyncBoxd], AsyncIterator[T]]) -> Iterator[T]:
        loop, client = self._running()
        iterator = use(client)
        try:
            while True:
                try:
                    yield self._wait(loop, anext(iterator))
                except StopAsyncIteration:
                    return
        finally:
            self._wait(loop, iterator.aclose())

    def close(self) -> None:
        with self._lock:
            if self._pid != os.getpid() or self._loop is None or self._client is None:
                return
            self._wait(self._loop, self._client.close())
            self._loop.call_soon_threadsafe(self._loop.stop)
            assert self._thread is not None
            self._thread.join()
            self._loop.close()
            self._pid = self._loop = self._thread = self._client = None


class Files:
    def __init__(self, portal: Portal) -> None:
        self._portal = portal

    @_mirrors(AsyncFiles.upload)
    def upload(
        self, machine: MachineRef, path: str, content: Content, *, mode: int | None = None, user: str | None = None
    ) -> FileWritten:
        return self._portal.call(lambda c: c.machines.files.upload(machine, path, content, mode=mode, user=user))

    @_mirrors(AsyncFiles.download)
    def download(self, machine: MachineRef, path: str) -> bytes:
        return self._portal.call(lambda c: c.machines.files.download(machine, path))

    @_mirrors(AsyncFiles.download_to)
    def download_to(self, machine: MachineRef, path: str, destination: str | Path) -> int:
        return self._portal.call(lambda c: c.machines.files.download_to(machine, path, destination))


class Checkpoints:
    def __init__(self, portal: Portal) -> None:
        self._portal = portal

    @_mirrors(AsyncCheckpoints.save)
    def save(self, machine: MachineRef, name: str) -> Checkpoint:
        return self._portal.call(lambda c: c.machines.checkpoints.save(machine, name))

    @_mirrors(AsyncCheckpoints.restore)
    def restore(self, machine: MachineRef, name: str) -> Machine:
        return self._portal.call(lambda c: c.machines.checkpoints.restore(machine, name))

    @_mirrors(AsyncCheckpoints.list)
    def list(self, machine: MachineRef) -> list[Checkpoint]:
        return self._portal.call(lambda c: c.machines.checkpoints.list(machine))

    @_mirrors(AsyncCheckpoints.delete)
    def delete(self, machine: MachineRef, name: str) -> None:
        self._portal.call(lambda c: c.machines.checkpoints.delete(machine, name))


class Machines:
    def __init__(self, portal: Portal) -> None:
        self._portal = portal
        self.files = Files(portal)
        self.checkpoints = Checkpoints(portal)

    @_mirrors(AsyncMachines.new)
    def new(
        self,
        name: str,
        *,
        vcpus: int = 1,
        memory_mib: int = 512,
        disk_gib: int = 4,
        isolated: bool = False,
        from_snapshot: str | None = None,
        suspend_after_s: float | None = None,
        hibernate_after_s: float | None = None,
        http_port: int = 8080,
        public: bool = False,
        host: str | None = None,
    ) -> Machine:
        return self._portal.call(
            lambda c: c.machines.new(
                name, vcpus=vcpus, memory_mib=memory_mib, disk_gib=disk_gib, isolated=isolated,
                from_snapshot=from_snapshot, suspend_after_s=suspend_after_s, hibernate_after_s=hibernate_after_s,
                http_port=http_port, public=public, host=host,
            )
        )

    @_mirrors(AsyncMachines.get)
    def get(self, machine: MachineRef) -> Machine:
        return self._portal.call(lambda c: c.machines.get(machine))

    @_mirrors(AsyncMachines.list)
    def list(self) -> list[Machine]:
        return self._portal.call(lambda c: c.machines.list())

    @_mirrors(AsyncMachines.delete)
    def delete(self, machine: MachineRef) -> Machine:
        return self._portal.call(lambda c: c.machines.delete(machine))

    @_mirrors(AsyncMachines.fork)
    def fork(self, source: MachineRef, name: str, *, host: str | None = None) -> Machine:
        return self._portal.call(lambda c: c.machines.fork(source, name, host=host))

    @_mirrors(AsyncMachines.suspend)
    def suspend(self, machine: MachineRef) -> Machine:
        return self._portal.call(lambda c: c.machines.suspend(machine))

    @_mirrors(AsyncMachines.hibernate)
    def hibernate(self, machine: MachineRef) -> Machine:
        return self._portal.call(lambda c: c.machines.hibernate(machine))

    @_mirrors(AsyncMachines.resume)
    def resume(self, machine: MachineRef) -> Machine:
        return self._portal.call(lambda c: c.machines.resume(machine))

    @_mirrors(AsyncMachines.wait_until_ready)
    def wait_until_ready(self, machine: MachineRef, timeout: float = 120) -> Machine:
        return self._portal.call(lambda c: c.machines.wait_until_ready(machine, timeout))

    @_mirrors(AsyncMachines.exec)
    def exec(
        self,
        machine: MachineRef,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
    ) -> ExecResult:
        return self._portal.call(
            lambda c: c.machines.exec(machine, cmd, timeout=timeout, env=env, cwd=cwd, user=user, stdin=stdin)
        )

    @_mirrors(AsyncMachines.exec_stream)
    def exec_stream(
        self,
        machine: MachineRef,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
    ) -> Iterator[ExecEvent]:
        return self._portal.iterate(
            lambda c: c.machines.exec_stream(machine, cmd, timeout=timeout, env=env, cwd=cwd, user=user, stdin=stdin)
        )


class Snapshots:
    def __init__(self, portal: Portal) -> None:
        self._portal = portal

    @_mirrors(AsyncSnapshots.save)
    def save(
        self,
        machine: MachineRef,
        name: str,
        *,
        wait: bool = True,
        timeout: float = 600,
        progress: Callable[[Snapshot], None] | None = None,
    ) -> Snapshot:
        # progress is called on the portal's thread, between polls.
        return self._portal.call(
            lambda c: c.snapshots.save(machine, name, wait=wait, timeout=timeout, progress=progress)
        )

    @_mirrors(AsyncSnapshots.get)
    def get(self, ref: str) -> Snapshot:
        return self._portal.call(lambda c: c.snapshots.get(ref))

    @_mirrors(AsyncSnapshots.list)
    def list(self) -> list[Snapshot]:
        return self._portal.call(lambda c: c.snapshots.list())

    @_mirrors(AsyncSnapshots.delete)
    def delete(self, ref: str) -> list[Snapshot]:
        return self._portal.call(lambda c: c.snapshots.delete(ref))


class Admin:
    def __init__(self, portal: Portal) -> None:
        self._portal = portal

    @_mirrors(AsyncAdmin.set_account)
    def set_account(self, name: str, *, max_machines: int | None = None) -> Account:
        return self._portal.call(lambda c: c.admin.set_account(name, max_machines=max_machines))

    @_mirrors(AsyncAdmin.list_accounts)
    def list_accounts(self) -> list[Account]:
        return self._portal.call(lambda c: c.admin.list_accounts())

    @_mirrors(AsyncAdmin.create_key)
    def create_key(self, account: str = "local", *, name: str | None = None) -> CreatedKey:
        return self._portal.call(lambda c: c.admin.create_key(account, name=name))

    @_mirrors(AsyncAdmin.list_keys)
    def list_keys(self) -> list[ApiKey]:
        return self._portal.call(lambda c: c.admin.list_keys())

    @_mirrors(AsyncAdmin.revoke_key)
    def revoke_key(self, key_id: str) -> ApiKey:
        return self._portal.call(lambda c: c.admin.revoke_key(key_id))


class Boxd:
    """A client of one boxd daemon; see ``AsyncBoxd`` for where it connects and with which key.

    Safe to share between threads.
    """

    def __init__(
        self,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint = resolve_endpoint(base_url)  # a bad base_url fails here, in the caller's thread
        self._portal = Portal(lambda: AsyncBoxd(api_key, base_url, timeout, transport=transport))
        self.machines = Machines(self._portal)
        self.snapshots = Snapshots(self._portal)
        self.admin = Admin(self._portal)

    def __enter__(self) -> Boxd:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        self._portal.close()

    @_mirrors(AsyncBoxd.health)
    def health(self) -> Health:
        return self._portal.call(lambda c: c.health())
