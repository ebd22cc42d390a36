"""The SDK itself, asynchronous. ``Boxd`` (sync) is a thin face over this same code.

    async with AsyncBoxd() as boxd:
        machine = await boxd.machines.new("rl-base")
        await boxd.machines.wait_until_ready(machine)
        result = await boxd.machines.exec(machine, "python3 -c 'print(42)'")

Every call that takes a machine accepts a ``Machine`` or its name or id, and every call
that takes a snapshot its NAME (newest ready version), NAME@VERSION or digest.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import os
import time
from collections.abc import AsyncIterator, Callable, Mapping, Sequence
from pathlib import Path
from typing import IO, Any, TypeVar
from urllib.parse import quote

import httpx
from pydantic import BaseModel, TypeAdapter

from boxd import __version__
from boxd.errors import BoxdError, Conflict, DaemonUnavailable, InvalidInput, Timeout, error_from_dict
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
    SnapshotState,
)
from boxd.sdk.connection import Endpoint, KeyFileAuth, ensure_local_daemon, local_key, resolve_endpoint

DEFAULT_TIMEOUT = 60.0
# Creating the first machine may build the guest image first (about 90 s, more on a slow host).
CREATE_TIMEOUT = 900.0
# On top of a command's own timeout: the daemon may first wait for a starting machine.
SERVER_MARGIN = 150.0
UPLOAD_CHUNK = 1024 * 1024
# Writing a machine's RAM out to hibernate it, or reading it back to wake it, may take
# minutes (the runtime allows 600 s), after waiting for a starting machine.
HIBERNATION_TIMEOUT = 600.0 + SERVER_MARGIN
# How often a snapshot being saved is asked about; its progress moves about this fast.
SNAPSHOT_POLL_S = 0.25

M = TypeVar("M", bound=BaseModel)
MachineRef = Machine | str
Content = str | bytes | bytearray | memoryview | IO[bytes]


def _machine_ref(machine: MachineRef) -> str:
    ref = machine.id if isinstance(machine, Machine) else machine
    if not isinstance(ref, str) or not ref:
        raise InvalidInput(f"machine: expected a Machine or a name or id, got {machine!r}", field="machine")
    return ref


def _machine_path(machine: MachineRef, *rest: str) -> str:
    return "/".join(["/v1/machines", quote(_machine_ref(machine), safe=""), *rest])


def _checkpoint_path(machine: MachineRef, name: str, *rest: str) -> str:
    return _machine_path(machine, "checkpoints", quote(name, safe=""), *rest)


def _snapshot_path(ref: str) -> str:
    return f"/v1/snapshots/{quote(ref, safe='')}"


def _waiting_for_ready(timeout: float) -> httpx.Timeout:
    # The daemon may first wait for a starting machine, or for a rewound one to answer.
    return httpx.Timeout(timeout, read=SERVER_MARGIN)


def _error_of(response: httpx.Response) -> BoxdError:
    """The error a daemon answered, rebuilt as its class by its code."""
    try:
        body = response.json()["error"]
        return error_from_dict(body)
    except (ValueError, KeyError, TypeError):
        return BoxdError(f"HTTP {response.status_code} from the daemon: {response.text[:300]}")


def _exec_body(
    cmd: str | Sequence[str],
    *,
    timeout: float | None,
    env: Mapping[str, str] | None,
    cwd: str | None,
    user: str | None,
    stdin: str | bytes | None,
) -> dict[str, Any]:
    body: dict[str, Any] = {"cmd": cmd} if isinstance(cmd, str) else {"argv": list(cmd)}
    if timeout is not None:
        body["timeout"] = timeout
    if env:
        body["env"] = dict(env)
    if cwd is not None:
        body["cwd"] = cwd
    if user is not None:
        body["user"] = user
    if stdin is not None:
        data = stdin.encode() if isinstance(stdin, str) else stdin
        body["stdin_b64"] = base64.b64encode(data).decode()
    return body


def _exec_timeout(command_timeout: float | None) -> httpx.Timeout:
    # Output may pause for as long as the command likes, so reads wait as long as it may run.
    read = None if command_timeout is None else command_timeout + SERVER_MARGIN
    return httpx.Timeout(DEFAULT_TIMEOUT, read=read)


async def _chunks_of(handle: IO[bytes]) -> AsyncIterator[bytes]:
    while chunk := await asyncio.to_thread(handle.read, UPLOAD_CHUNK):
        yield chunk.encode() if isinstance(chunk, str) else chunk


def _upload_body(content: Content) -> bytes | AsyncIterator[bytes]:
    if isinstance(content, str):
        return content.encode()
    if isinstance(content, (bytes, bytearray, memoryview)):
        return bytes(content)
    if hasattr(content, "read"):
        return _chunks_of(content)
    raise InvalidInput(
        f"content: expected str, bytes or a binary file object, got {type(content).__name__}", field="content"
    )


class AsyncBoxd:
    """A client of one boxd daemon.

    ``api_key`` defaults to ``BOXD_API_KEY``, ``base_url`` to ``BOXD_URL`` (``http(s)://``
    or ``unix://PATH``). With neither URL, the client uses, inside a boxd machine, the
    daemon that runs the machine and the machine's key; elsewhere the local daemon of
    ``BOXD_HOME`` (starting it if needed) and, with no key given, its local key.
    """

    def __init__(
        self,
        api_key: str | None = None,
        base_url: str | None = None,
        timeout: float = DEFAULT_TIMEOUT,
        *,
        transport: httpx.AsyncBaseTransport | None = None,
    ) -> None:
        self.endpoint: Endpoint = resolve_endpoint(base_url)
        self.timeout = timeout
        self._api_key = api_key or os.environ.get("BOXD_API_KEY")
        self._transport = transport
        self._http: httpx.AsyncClient | None = None
        self._connecting = asyncio.Lock()
        self.machines = AsyncMachines(self)
        self.snapshots = AsyncSnapshots(self)
        self.admin = AsyncAdmin(self)

    async def __aenter__(self) -> AsyncBoxd:
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        await self.close()

    async def close(self) -> None:
        if self._http is not None:
            await self._http.aclose()
            self._http = None

    async def health(self) -> Health:
        return await self._call(Health, "GET", "/v1/health")

    # -- transport --------------------------------------------------------------------

    async def _client(self) -> httpx.AsyncClient:
        async with self._connecting:
            if self._http is None:
                self._http = await self._open()
            return self._http

    async def _open(self) -> httpx.AsyncClient:
        endpoint = self.endpoint
        if endpoint.home is not None and self._transport is None:
            await ensure_local_daemon(endpoint.home)
        key = self._api_key or (local_key(endpoint.home) if endpoint.home is not None else None)
        headers = {"user-agent": f"boxd-python/{__version__}"}
        if key:
            headers["authorization"] = f"Bearer {key}"
        auth = KeyFileAuth(endpoint.key_file) if endpoint.key_file is not None and not key else None
        transport = self._transport or httpx.AsyncHTTPTransport(
            uds=None if endpoint.uds is None else str(endpoint.uds)
        )
        return httpx.AsyncClient(
            base_url=endpoint.base_url, headers=headers, auth=auth, timeout=self.timeout, transport=transport
        )

    def _unreachable(self, error: httpx.TransportError) -> DaemonUnavailable:
        where = self.endpoint.uds or self.endpoint.base_url
        return DaemonUnavailable(f"cannot reach the boxd daemon at {where}: {error or type(error).__name__}")

    @contextlib.asynccontextmanager
    async def _stream(self, method: str, path: str, **options: Any) -> AsyncIterator[httpx.Response]:
        """A response whose body is still to be read; an error answer raises its BoxdError."""
        client = await self._client()
        try:
            async with client.stream(method, path, **options) as response:
                if response.status_code >= 400:
                    await response.aread()
                    raise _error_of(response)
                yield response
        except httpx.TransportError as error:
            raise self._unreachable(error) from error

    async def _request(self, method: str, path: str, **options: Any) -> httpx.Response:
        async with self._stream(method, path, **options) as response:
            await response.aread()
            return response

    async def _call(self, model: type[M], method: str, path: str, **options: Any) -> M:
        response = await self._request(method, path, **options)
        return model.model_validate_json(response.content)

    async def _call_list(self, model: type[M], method: str, path: str, **options: Any) -> list[M]:
        response = await self._request(method, path, **options)
        return TypeAdapter(list[model]).validate_json(response.content)


class AsyncFiles:
    def __init__(self, client: AsyncBoxd) -> None:
        self._client = client

    async def upload(
        self, machine: MachineRef, path: str, content: Content, *, mode: int | None = None, user: str | None = None
    ) -> FileWritten:
        """Write ``content`` (str, bytes or a binary file, streamed) to ``path`` in the machine."""
        params: dict[str, Any] = {"path": path}
        if mode is not None:
            params["mode"] = mode
        if user is not None:
            params["user"] = user
        return await self._client._call(
            FileWritten, "PUT", _machine_path(machine, "files"), params=params, content=_upload_body(content),
            headers={"content-type": "application/octet-stream"},
        )

    async def download(self, machine: MachineRef, path: str) -> bytes:
        response = await self._client._request("GET", _machine_path(machine, "files"), params={"path": path})
        return response.content

    async def download_to(self, machine: MachineRef, path: str, destination: str | Path) -> int:
        """Stream a file of the machine into a local file; returns its size."""
        size = 0
        async with self._client._stream("GET", _machine_path(machine, "files"), params={"path": path}) as response:
            with open(destination, "wb") as handle:
                async for chunk in response.aiter_bytes():
                    await asyncio.to_thread(handle.write, chunk)
                    size += len(chunk)
        return size


class AsyncCheckpoints:
    """Instants of a machine kept to rewind it to, in place; they go when the machine does."""

    def __init__(self, client: AsyncBoxd) -> None:
        self._client = client

    async def save(self, machine: MachineRef, name: str) -> Checkpoint:
        """Keep this instant of a running machine as ``name``; it pauses only briefly."""
        return await self._client._call(
            Checkpoint, "POST", _machine_path(machine, "checkpoints"), json={"name": name},
            timeout=_waiting_for_ready(self._client.timeout),
        )

    async def restore(self, machine: MachineRef, name: str) -> Machine:
        """Rewind the machine to the checkpoint (same name and id); returns once it runs again."""
        return await self._client._call(
            Machine, "POST", _checkpoint_path(machine, name, "restore"), timeout=_waiting_for_ready(self._client.timeout)
        )

    async def list(self, machine: MachineRef) -> list[Checkpoint]:
        return await self._client._call_list(Checkpoint, "GET", _machine_path(machine, "checkpoints"))

    async def delete(self, machine: MachineRef, name: str) -> None:
        await self._client._request("DELETE", _checkpoint_path(machine, name))


class AsyncMachines:
    def __init__(self, client: AsyncBoxd) -> None:
        self._client = client
        self.files = AsyncFiles(client)
        self.checkpoints = AsyncCheckpoints(client)

    async def new(
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
        """Start a machine; it is ``starting`` until ``wait_until_ready`` returns.

        With ``from_snapshot`` it starts at that snapshot's instant, and takes its size
        and isolation from the snapshot.

        Idle, it is suspended after ``suspend_after_s`` seconds and hibernated
        ``hibernate_after_s`` seconds later (None: the daemon's default, 0: never); any
        use wakes it. Its URL (``Machine.url``) leads to port ``http_port`` in it, and
        answers without the account's key if ``public``. On a cluster, ``host`` is where it
        goes (default: the roomiest of a few hosts).
        """
        # Validated by the daemon, which owns the rules (some depend on its host).
        body: dict[str, Any] = {
            "name": name, "vcpus": vcpus, "memory_mib": memory_mib, "disk_gib": disk_gib, "isolated": isolated
        }
        # Each only when used: an older daemon refuses fields it does not know.
        optional = {
            "from_snapshot": (from_snapshot, None),
            "suspend_after_s": (suspend_after_s, None),
            "hibernate_after_s": (hibernate_after_s, None),
            "http_port": (http_port, 8080),
            "public": (public, False),
            "host": (host, None),
        }
        body.update({field: value for field, (value, default) in optional.items() if value != default})
        timeout = httpx.Timeout(self._client.timeout, read=CREATE_TIMEOUT)
        return await self._client._call(Machine, "POST", "/v1/machines", json=body, timeout=timeout)

    async def fork(self, source: MachineRef, name: str, *, host: str | None = None) -> Machine:
        """A new machine that continues from this instant of ``source`` (which keeps running);
        on a cluster, ``host`` is where it goes (default: the source's host while it has room)."""
        body = {"name": name, **({"host": host} if host is not None else {})}
        return await self._client._call(Machine, "POST", _machine_path(source, "fork"), json=body)

    async def get(self, machine: MachineRef) -> Machine:
        return await self._client._call(Machine, "GET", _machine_path(machine))

    async def list(self) -> list[Machine]:
        return await self._client._call_list(Machine, "GET", "/v1/machines")

    async def delete(self, machine: MachineRef) -> Machine:
        return await self._client._call(Machine, "DELETE", _machine_path(machine))

    async def suspend(self, machine: MachineRef) -> Machine:
        """Stop the machine's vCPUs, keeping its memory; it is ``paused`` until used or resumed."""
        return await self._client._call(
            Machine, "POST", _machine_path(machine, "suspend"), timeout=_waiting_for_ready(self._client.timeout)
        )

    async def hibernate(self, machine: MachineRef) -> Machine:
        """Save the machine's whole state to disk and end its process; it is ``stopped``, no
        longer counts against the quota, and wakes when used or resumed (if the quota allows)."""
        return await self._client._call(
            Machine, "POST", _machine_path(machine, "hibernate"),
            timeout=httpx.Timeout(self._client.timeout, read=HIBERNATION_TIMEOUT),
        )

    async def resume(self, machine: MachineRef) -> Machine:
        """Wake a suspended machine (``running`` again), or a hibernated one (``starting``
        until ``wait_until_ready`` returns); ``QuotaExceeded`` leaves a hibernated one stopped."""
        return await self._client._call(
            Machine, "POST", _machine_path(machine, "resume"),
            timeout=httpx.Timeout(self._client.timeout, read=HIBERNATION_TIMEOUT),
        )

    async def wait_until_ready(self, machine: MachineRef, timeout: float = 120) -> Machine:
        """Return once the machine runs; ``Timeout`` if it does not in time, ``Conflict`` if it failed."""
        return await self._client._call(
            Machine, "POST", _machine_path(machine, "wait"), params={"timeout": timeout},
            timeout=httpx.Timeout(self._client.timeout, read=timeout + 30),
        )

    async def exec(
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
        """Run a command to its end: ``cmd`` as a string goes to the shell, as a list it is argv."""
        body = _exec_body(cmd, timeout=timeout, env=env, cwd=cwd, user=user, stdin=stdin)
        return await self._client._call(
            ExecResult, "POST", _machine_path(machine, "exec"), json=body, timeout=_exec_timeout(timeout)
        )

    async def exec_stream(
        self,
        machine: MachineRef,
        cmd: str | Sequence[str],
        *,
        timeout: float | None = None,
        env: Mapping[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: str | bytes | None = None,
    ) -> AsyncIterator[ExecEvent]:
        """Run a command, yielding its events as they happen: started, stdout/stderr, exit."""
        body = _exec_body(cmd, timeout=timeout, env=env, cwd=cwd, user=user, stdin=stdin)
        path = _machine_path(machine, "exec", "stream")
        async with self._client._stream("POST", path, json=body, timeout=_exec_timeout(timeout)) as response:
            async for line in response.aiter_lines():
                if not line.strip():
                    continue
                item = ExecEvent.model_validate_json(line)
                if item.type == "error":
                    raise error_from_dict(item.error or {})
                yield item


class AsyncSnapshots:
    """Named, versioned baselines saved from a machine; they outlive it."""

    def __init__(self, client: AsyncBoxd) -> None:
        self._client = client

    async def save(
        self,
        machine: MachineRef,
        name: str,
        *,
        wait: bool = True,
        timeout: float = 600,
        progress: Callable[[Snapshot], None] | None = None,
    ) -> Snapshot:
        """Save a new version of ``name`` from a running machine, which pauses only briefly.

        With ``wait`` (the default) returns once the version is ``ready``, calling
        ``progress`` with each state seen on the way; ``Conflict`` if saving failed,
        ``Timeout`` if it is not done within ``timeout`` seconds. Without, returns the
        version while it is still ``saving``.
        """
        snapshot = await self._client._call(
            Snapshot, "POST", "/v1/snapshots", json={"machine": _machine_ref(machine), "name": name},
            timeout=_waiting_for_ready(self._client.timeout),
        )
        if not wait:
            return snapshot
        deadline = time.monotonic() + timeout
        while True:
            if progress is not None:
                progress(snapshot)
            if snapshot.state is SnapshotState.READY:
                return snapshot
            if snapshot.state is SnapshotState.FAILED:
                raise Conflict(f"snapshot {snapshot.ref} failed: {snapshot.reason}")
            if time.monotonic() >= deadline:
                raise Timeout(f"snapshot {snapshot.ref}: still saving after {timeout:g} s")
            await asyncio.sleep(SNAPSHOT_POLL_S)
            snapshot = await self.get(snapshot.ref)

    async def get(self, ref: str) -> Snapshot:
        return await self._client._call(Snapshot, "GET", _snapshot_path(ref))

    async def list(self) -> list[Snapshot]:
        """Every version of every snapshot of your account."""
        return await self._client._call_list(Snapshot, "GET", "/v1/snapshots")

    async def delete(self, ref: str) -> list[Snapshot]:
        """NAME@VERSION (or a digest) deletes that version, NAME all of them; returns what went."""
        return await self._client._call_list(Snapshot, "DELETE", _snapshot_path(ref))


class AsyncAdmin:
    """Accounts and keys: only the local daemon's unix socket serves these."""

    def __init__(self, client: AsyncBoxd) -> None:
        self._client = client

    async def set_account(self, name: str, *, max_machines: int | None = None) -> Account:
        body = {"max_machines": max_machines}
        return await self._client._call(Account, "PUT", f"/v1/admin/accounts/{quote(name, safe='')}", json=body)

    async def list_accounts(self) -> list[Account]:
        return await self._client._call_list(Account, "GET", "/v1/admin/accounts")

    async def create_key(self, account: str = "local", *, name: str | None = None) -> CreatedKey:
        body = {"account": account, "name": name}
        return await self._client._call(CreatedKey, "POST", "/v1/admin/keys", json=body)

    async def list_keys(self) -> list[ApiKey]:
        return await self._client._call_list(ApiKey, "GET", "/v1/admin/keys")

    async def revoke_key(self, key_id: str) -> ApiKey:
        return await self._client._call(ApiKey, "DELETE", f"/v1/admin/keys/{quote(key_id, safe='')}")
