"""The host's side of the in-guest agent protocol (see ``boxd.guest.agent``).

One ``AgentClient`` holds the single connection QEMU's chardev accepts for a machine and
multiplexes every request over it: many commands may stream at once while files move.
It also serves tunnels (``serve_tunnels``): connections made to a port inside the
guest, each carried to a fresh host connection; only bytes move, nothing here knows
what they mean. Tunnels belong to one agent connection: when it ends, they close.
"""

from __future__ import annotations

import asyncio
import base64
import contextlib
import itertools
import json
import logging
import secrets
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from boxd.errors import (
    AgentUnavailable,
    BoxdError,
    Conflict,
    HostError,
    InvalidInput,
    NotFound,
    Timeout,
    Unsupported,
    VMError,
)

log = logging.getLogger(__name__)

LINE_LIMIT = 16 * 1024 * 1024
FILE_CHUNK = 512 * 1024
WINDOW = 4  # file chunks in flight at once
TUNNEL_CHUNK = 64 * 1024  # bytes read from a host connection at a time
# As in the agent: bytes of one tunnel connection in flight, and how often what was
# delivered is acknowledged (also whenever nothing more is queued).
TUNNEL_WINDOW = 1 << 20
TUNNEL_ACK_EVERY = 256 * 1024
TUNNEL_EVENTS = frozenset({"tunnel_open", "tunnel_data", "tunnel_ack", "tunnel_close"})
# What a watch yields first, once the guest watches the folder: until then a change
# could be missed, and a folder that cannot be watched fails the watch instead.
WATCH_STARTED = ("", "started")

TunnelConnect = Callable[[], Awaitable[tuple[asyncio.StreamReader, asyncio.StreamWriter]]]


class _ConnectionLost(Exception):
    pass


def fault_to_error(event: dict[str, Any]) -> BoxdError:
    """Map an agent's error code (never its wording) onto boxd's hierarchy."""
    code, message = event.get("code", "internal"), event.get("message", "agent error")
    by_code: dict[str, type[BoxdError]] = {
        "not_found": NotFound,
        "invalid_input": InvalidInput,
        "permission_denied": InvalidInput,
        "conflict": Conflict,
        "command_not_found": NotFound,
        "unsupported": Unsupported,
        "no_space": HostError,
    }
    cls = by_code.get(code, VMError)
    if cls in (InvalidInput, Conflict):
        return cls(message, field=event.get("field"))
    return cls(message, agent_code=code)


@dataclass
class ExecEvent:
    """What a running command reports: started, stdout and stderr (or pty), then exit."""

    kind: str
    data: bytes = b""
    pid: int | None = None
    exit_code: int | None = None
    signal: int | None = None
    timed_out: bool = False


@dataclass
class _Pending:
    queue: asyncio.Queue = field(default_factory=asyncio.Queue)


@dataclass
class _Tunnel:
    """The host's half of one connection made in the guest."""

    conn: int
    inbox: asyncio.Queue = field(default_factory=asyncio.Queue)  # bytes from the guest; None once it closed
    unacked: int = 0  # bytes sent to the guest and not acknowledged yet
    credit: asyncio.Event = field(default_factory=asyncio.Event)
    guest_closed: bool = False
    lost: bool = False  # the agent connection that carried it ended
    task: asyncio.Task | None = None


class AgentClient:
    def __init__(self, socket_path: Path, *, name: str = "") -> None:
        self.socket_path = Path(socket_path)
        self.name = name
        self._reader: asyncio.StreamReader | None = None
        self._writer: asyncio.StreamWriter | None = None
        self._read_task: asyncio.Task | None = None
        self._pending: dict[str, _Pending] = {}
        self._connect_lock = asyncio.Lock()
        self._ready = False
        # A prefix per client keeps ids unique across daemon restarts and forks.
        self._prefix = secrets.token_hex(6)
        self._counter = itertools.count(1)
        self._tunnel_targets: dict[int, TunnelConnect] = {}  # guest port -> how to reach its target
        self._tunnels: dict[int, _Tunnel] = {}

    # -- connection -------------------------------------------------------------------

    @property
    def connected(self) -> bool:
        return self._writer is not None and self._ready

    async def connect(self, timeout: float) -> dict[str, Any]:
        """Connect and wait until the agent answers a ping; returns the ping's answer."""
        deadline = time.monotonic() + timeout
        async with self._connect_lock:
            if self._writer is None:
                await self._open(deadline)
            try:
                answer = await self._call_raw({"op": "ping"}, deadline - time.monotonic())
            except (asyncio.TimeoutError, _ConnectionLost):
                await self._drop()
                raise AgentUnavailable(
                    f"machine {self.name}: the guest agent did not answer within {timeout:.0f} s"
                ) from None
            self._ready = True
            return answer

    async def _open(self, deadline: float) -> None:
        while True:
            try:
                self._reader, self._writer = await asyncio.open_unix_connection(
                    str(self.socket_path), limit=LINE_LIMIT
                )
                break
            except (FileNotFoundError, ConnectionRefusedError):
                if time.monotonic() >= deadline:
                    raise AgentUnavailable(
                        f"machine {self.name}: no agent socket at {self.socket_path}"
                    ) from None
                await asyncio.sleep(0.02)
        # Ends any half line an earlier connection left in the guest's input, then closes
        # the guest's tunnel connections of an earlier host, which nothing carries now.
        self._writer.write(b"\n")
        self._send({"op": "tunnel_reset"})
        self._read_task = asyncio.create_task(self._read_loop())

    async def _read_loop(self) -> None:
        assert self._reader is not None
        try:
            while True:
                line = await self._reader.readline()
                if not line:
                    break
                try:
                    message = json.loads(line)
                except ValueError:
                    continue  # the tail of a line sent to an earlier connection
                if message.get("type") in TUNNEL_EVENTS:
                    self._on_tunnel_event(message)
                    continue
                pending = self._pending.get(str(message.get("id")))
                if pending is not None:
                    pending.queue.put_nowait(message)
        except (ConnectionError, asyncio.LimitOverrunError, ValueError) as error:
            log.warning("agent connection of %s broke: %s", self.name, error)
        finally:
            self._ready = False
            for pending in self._pending.values():
                pending.queue.put_nowait(_ConnectionLost())
            for tunnel in self._tunnels.values():
                tunnel.lost = True
                if tunnel.task is not None:
                    tunnel.task.cancel()
            self._tunnels.clear()

    async def _drop(self) -> None:
        self._ready = False
        writer, task = self._writer, self._read_task
        tunnels = [t.task for t in self._tunnels.values() if t.task is not None]
        self._writer = self._reader = self._read_task = None
        if writer is not None:
            writer.close()
            with contextlib.suppress(Exception):
                await writer.wait_closed()
        if task is not None:
            task.cancel()
            with contextlib.suppress(BaseException):
                await task
        # The read loop's end cancelled them; let them close their host connections.
        await asyncio.gather(*tunnels, return_exceptions=True)

    async def close(self) -> None:
        await self._drop()

    async def _ensure(self, timeout: float = 10.0) -> None:
        if not self.connected:
            if self._writer is not None:
                await self._drop()
            await self.connect(timeout)

    # -- requests ---------------------------------------------------------------------

    def _new_id(self) -> str:
        return f"{self._prefix}-{next(self._counter)}"

    def _send(self, request: dict[str, Any]) -> None:
        if self._writer is None:
            raise _ConnectionLost()
        self._writer.write(json.dumps(request, separators=(",", ":")).encode() + b"\n")

    async def _send_drained(self, request: dict[str, Any]) -> None:
        """Send, then wait until the connection has room again (the guest reads at its pace)."""
        self._send(request)
        assert self._writer is not None
        await self._writer.drain()

    async def _call_raw(self, request: dict[str, Any], timeout: float | None) -> dict[str, Any]:
        request_id = self._new_id()
        pending = self._pending[request_id] = _Pending()
        try:
            await self._send_drained({"id": request_id, **request})
            message = await asyncio.wait_for(pending.queue.get(), timeout)
        finally:
            self._pending.pop(request_id, None)
        if isinstance(message, _ConnectionLost):
            raise message
        return message

    async def call(self, op: str, *, timeout: float | None = 60.0, **fields: Any) -> dict[str, Any]:
        """One request, one answer; raises the boxd error the agent's code maps to."""
        await self._ensure()
        try:
            message = await self._call_raw({"op": op, **fields}, timeout)
        except asyncio.TimeoutError:
            raise Timeout(f"machine {self.name}: agent operation {op} took over {timeout} s") from None
        except _ConnectionLost:
            raise AgentUnavailable(f"machine {self.name}: the agent connection was lost during {op}") from None
        if message.get("type") == "error":
            raise fault_to_error(message)
        return message

    async def exec(
        self,
        *,
        argv: list[str] | None = None,
        shell: str | None = None,
        env: dict[str, str] | None = None,
        cwd: str | None = None,
        user: str | None = None,
        stdin: bytes | None = None,
        keep_stdin: bool = False,
        timeout: float | None = None,
        tag: str | None = None,
        pty: dict[str, int] | None = None,
    ) -> AsyncIterator[ExecEvent]:
        """Run a command and yield its events as they come, ending with ``exit``.

        With ``pty`` (``rows``, ``cols``) it runs in a terminal and its output comes as
        ``pty`` events. Leaving the iteration early leaves the command running.
        """
        request: dict[str, Any] = {"op": "exec", "env": env or {}, "cwd": cwd, "user": user, "tag": tag}
        if argv is not None:
            request["argv"] = argv
        else:
            request["shell"] = shell
        if stdin is not None:
            request["stdin_data"] = base64.b64encode(stdin).decode()
        request["stdin"] = keep_stdin
        if timeout is not None:
            request["timeout"] = timeout
        if pty is not None:
            request["pty"] = pty
        async for event in self._process_events(request, timeout):
            yield event

    async def attach(self, pid: int) -> AsyncIterator[ExecEvent]:
        """Follow a running process from now on: ``started``, its output, its exit."""
        async for event in self._process_events({"op": "attach", "pid": pid}, None):
            yield event

    async def watch(self, path: str, *, recursive: bool = False) -> AsyncIterator[tuple[str, str]]:
        """``WATCH_STARTED``, then the changes in a directory of the guest, as (name relative
        to it, event), until the iteration is left; the guest then stops watching."""
        request_id = self._new_id()
        try:
            async for message in self._messages(request_id, {"op": "watch", "path": path, "recursive": recursive}, None):
                if message.get("type") == "started":
                    yield WATCH_STARTED
                elif message.get("type") == "fs_event":
                    yield str(message.get("name")), str(message.get("event"))
        finally:
            if self.connected:
                with contextlib.suppress(BoxdError, _ConnectionLost):
                    self._send({"id": self._new_id(), "op": "unwatch", "target": request_id})

    async def _process_events(self, request: dict[str, Any], timeout: float | None) -> AsyncIterator[ExecEvent]:
        async for message in self._messages(self._new_id(), request, timeout):
            kind = message.get("type")
            if kind == "started":
                yield ExecEvent("started", pid=message.get("pid"))
            elif kind in ("stdout", "stderr", "pty"):
                yield ExecEvent(kind, data=base64.b64decode(message.get("data", "")))
            elif kind == "exit":
                yield ExecEvent(
                    "exit",
                    exit_code=message.get("exit_code"),
                    signal=message.get("signal"),
                    timed_out=bool(message.get("timed_out")),
                )

    async def _messages(
        self, request_id: str, request: dict[str, Any], timeout: float | None
    ) -> AsyncIterator[dict[str, Any]]:
        """What a streaming request gets back, through its ``exit``; an error answer raises."""
        await self._ensure()
        pending = self._pending[request_id] = _Pending()
        # The guest enforces a command's timeout; this margin only catches a guest that died.
        host_deadline = None if timeout is None else time.monotonic() + timeout + 30
        try:
            await self._send_drained({"id": request_id, **request})
            while True:
                remaining = None if host_deadline is None else max(0.0, host_deadline - time.monotonic())
                try:
                    message = await asyncio.wait_for(pending.queue.get(), remaining)
                except asyncio.TimeoutError:
                    raise Timeout(f"machine {self.name}: the command did not finish and the guest went silent") from None
                if isinstance(message, _ConnectionLost):
                    raise AgentUnavailable(f"machine {self.name}: the agent connection was lost during {request['op']}")
                if message.get("type") == "error":
                    raise fault_to_error(message)
                yield message
                if message.get("type") == "exit":
                    return
        finally:
            self._pending.pop(request_id, None)

    # -- files ------------------------------------------------------------------------

    async def write_file(
        self,
        path: str,
        chunks: AsyncIterator[bytes],
        *,
        mode: int | None = None,
        user: str | None = None,
    ) -> int:
        """Write a file from a stream of chunks; it appears whole only when complete."""
        upload = secrets.token_hex(8)
        offset = 0
        in_flight: list[asyncio.Task] = []

        async def send(data: bytes, at: int, last: bool) -> None:
            await self.call(
                "write_file", path=path, upload=upload, offset=at, last=last,
                data=base64.b64encode(data).decode(), mode=mode, user=user,
            )

        # The first chunk goes alone: it creates the file that later chunks write into.
        # The last one waits for all before it, since it renames the file into place.
        buffered = b""
        first = True
        try:
            async for piece in chunks:
                buffered += piece
                while len(buffered) > FILE_CHUNK:
                    data, buffered = buffered[:FILE_CHUNK], buffered[FILE_CHUNK:]
                    if first:
                        await send(data, offset, False)
                        first = False
                    else:
                        in_flight.append(asyncio.create_task(send(data, offset, False)))
                        if len(in_flight) >= WINDOW:
                            await in_flight.pop(0)
                    offset += len(data)
            for task in in_flight:
                await task
        finally:
            # Also when the source of chunks fails half-way: nothing keeps writing.
            for task in in_flight:
                task.cancel()
        await send(buffered, offset, True)
        return offset + len(buffered)

    async def read_file(self, path: str) -> AsyncIterator[bytes]:
        """Yield a file's bytes in order, a chunk at a time."""
        offset = 0
        while True:
            answer = await self.call("read_file", path=path, offset=offset, length=FILE_CHUNK)
            data = base64.b64decode(answer.get("data", ""))
            offset += len(data)
            if data:
                yield data
            if answer.get("eof") or not data:
                return

    async def set_time(self) -> None:
        await self.call("set_time", epoch_ns=time.time_ns())

    # -- tunnels ----------------------------------------------------------------------

    async def serve_tunnels(self, port: int, connect: TunnelConnect, *, host: str = "127.0.0.1") -> None:
        """Carry each connection made to ``host:port`` in the guest to a new ``connect()`` here.

        Idempotent. The guest's listener lives as long as its agent (a fork inherits it),
        while ``connect`` is this client's: call this each time the machine is ready.
        A connection whose ``connect()`` fails is closed in the guest.
        """
        self._tunnel_targets[port] = connect
        await self.call("tunnel_listen", port=port, host=host)

    def _on_tunnel_event(self, message: dict[str, Any]) -> None:
        """Runs in the read loop, so it only queues and starts tasks; it never waits."""
        conn, kind = message.get("conn"), message.get("type")
        if not isinstance(conn, int):
            return
        if kind == "tunnel_open":
            connect = self._tunnel_targets.get(message.get("port"))
            if connect is None:
                with contextlib.suppress(_ConnectionLost):
                    self._send({"op": "tunnel_close", "conn": conn})  # nothing here serves that port
                return
            tunnel = self._tunnels[conn] = _Tunnel(conn)
            tunnel.task = asyncio.create_task(self._carry(tunnel, connect))
            return
        tunnel = self._tunnels.get(conn)
        if tunnel is None:
            return  # ended here already
        if kind == "tunnel_data":
            try:
                tunnel.inbox.put_nowait(base64.b64decode(message.get("data_b64", ""), validate=True))
            except (ValueError, TypeError):
                tunnel.inbox.put_nowait(None)  # a garbled chunk: better a closed connection than a corrupt one
        elif kind == "tunnel_ack":
            acknowledged = message.get("bytes")
            tunnel.unacked -= acknowledged if isinstance(acknowledged, int) else 0
            tunnel.credit.set()
        else:
            tunnel.guest_closed = True
            tunnel.inbox.put_nowait(None)

    async def _carry(self, tunnel: _Tunnel, connect: TunnelConnect) -> None:
        """Move one connection's bytes both ways until either end closes, then close the other."""
        writer: asyncio.StreamWriter | None = None
        try:
            try:
                reader, writer = await connect()
            except Exception as error:  # whatever the target raises, the guest's client sees a close
                log.info("tunnel %s of %s: cannot connect to its target: %s", tunnel.conn, self.name, error)
                return
            pumps = [
                asyncio.create_task(self._guest_to_host(tunnel, writer)),
                asyncio.create_task(self._host_to_guest(tunnel, reader)),
            ]
            try:
                await asyncio.wait(pumps, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for pump in pumps:
                    pump.cancel()
                await asyncio.gather(*pumps, return_exceptions=True)
        finally:
            if self._tunnels.get(tunnel.conn) is tunnel:
                del self._tunnels[tunnel.conn]
            if not (tunnel.guest_closed or tunnel.lost):
                with contextlib.suppress(_ConnectionLost):
                    self._send({"op": "tunnel_close", "conn": tunnel.conn})
            if writer is not None:
                # It still sends what it holds, then closes; waiting for that could take for
                # ever (a target that stopped reading).
                writer.close()

    async def _guest_to_host(self, tunnel: _Tunnel, writer: asyncio.StreamWriter) -> None:
        delivered = 0
        while (data := await tunnel.inbox.get()) is not None:
            writer.write(data)
            await writer.drain()
            delivered += len(data)
            if delivered >= TUNNEL_ACK_EVERY or tunnel.inbox.empty():
                self._send({"op": "tunnel_ack", "conn": tunnel.conn, "bytes": delivered})
                delivered = 0

    async def _host_to_guest(self, tunnel: _Tunnel, reader: asyncio.StreamReader) -> None:
        while True:
            while tunnel.unacked >= TUNNEL_WINDOW:
                tunnel.credit.clear()
                await tunnel.credit.wait()
            data = await reader.read(TUNNEL_CHUNK)
            if not data:
                return
            tunnel.unacked += len(data)
            await self._send_drained(
                {"op": "tunnel_data", "conn": tunnel.conn, "data_b64": base64.b64encode(data).decode()}
            )
