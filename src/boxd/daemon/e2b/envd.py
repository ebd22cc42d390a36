"""envd, the API inside an E2B sandbox: processes and files over Connect RPC, ``/files``,
``/health``. Every call names its sandbox by the ``E2b-Sandbox-Id`` header and proves it
may by ``X-Access-Token``; the user comes as HTTP Basic (``user:``), default ``user``.
"""

from __future__ import annotations

import asyncio
import base64
import binascii
import contextlib
import posixpath
import secrets
import signal
import time
import zlib
from collections.abc import AsyncIterator
from typing import Any, TypeVar

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.datastructures import UploadFile

from boxd.daemon.e2b import envd_wire as wire
from boxd.daemon.e2b import signing
from boxd.daemon.e2b.connect import ConnectError, Message, parse_message, read_envelopes, server_stream, unary
from boxd.daemon.e2b.service import SandboxService, Target
from boxd.errors import AuthError, BoxdError, InvalidInput, NotFound, Unreachable
from boxd.models import MachineState
from boxd.runtime.agent_client import ExecEvent
from boxd.runtime.interface import ExecRequest

E2B_USER = "user"
KEEPALIVE_S = 30.0
UPLOAD_CHUNK = 512 * 1024

router = APIRouter()


def _service(request: Request) -> SandboxService:
    return request.app.state.sandboxes


def user_of(request: Request) -> str:
    """The user of an envd call: HTTP Basic ``user:`` (password unused), else ``user``."""
    scheme, _, value = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "basic" or not value:
        return request.query_params.get("username") or E2B_USER
    try:
        user = base64.b64decode(value, validate=True).decode().partition(":")[0]
    except (binascii.Error, UnicodeDecodeError):
        raise ConnectError("invalid_argument", "authorization: not a Basic user:password pair") from None
    return user or E2B_USER


async def _target(request: Request) -> Target:
    return await _service(request).envd_target(
        request.headers.get("e2b-sandbox-id"), request.headers.get("x-access-token")
    )


async def _file_target(request: Request, operation: str) -> Target:
    """``/files`` also takes a signature made with the sandbox's token in place of the token
    (the SDKs' download_url and upload_url). Such a URL may name no sandbox: the one whose
    token made the signature is it."""
    signature = request.query_params.get("signature")
    if signature is None or request.headers.get("x-access-token"):
        return await _target(request)
    expiration = request.query_params.get("signature_expiration")
    try:
        expires_at = None if expiration is None else int(expiration)
    except ValueError:
        raise InvalidInput("signature_expiration: not a Unix time in seconds", field="signature_expiration") from None

    def signed_with(token: str) -> bool:
        return signing.signed_with(token, signature, path=request.query_params.get("path", ""), operation=operation,
                                   username=request.query_params.get("username", ""), expiration=expires_at)

    record = _service(request).signer_of(signed_with, request.headers.get("e2b-sandbox-id"))
    # envd's own words, which the SDKs' tests read.
    if record is None:
        raise AuthError("invalid signature")
    if signing.expired(expires_at):
        raise AuthError("signature is already expired")
    return await _service(request).envd_target(record.machine, record.access_token)


def _timeout_of(request: Request) -> float | None:
    value = request.headers.get("connect-timeout-ms")
    try:
        # e2b 2.7 sends str(seconds * 1000), which is "500.0" for a float timeout.
        return float(value) / 1000 if value and float(value) > 0 else None
    except ValueError:
        raise ConnectError("invalid_argument", f"connect-timeout-ms: not a number: {value!r}") from None


async def _single_message(request: Request, model: type[Message]) -> Message:
    async for data in read_envelopes(request):
        return parse_message(model, data)
    raise ConnectError("invalid_argument", "the request stream holds no message")


# -- processes ----------------------------------------------------------------------------


def _end_event(event: ExecEvent) -> wire.EndEvent:
    """As Go's os/exec (envd's) reports a process's end."""
    if event.signal:
        name = _SIGNAL_WORDS.get(event.signal, f"signal {event.signal}")
        return wire.EndEvent(exit_code=-1, exited=False, status=f"signal: {name}", error=f"signal: {name}")
    code = event.exit_code or 0
    return wire.EndEvent(exit_code=code, exited=True, status=f"exit status {code}",
                         error=None if code == 0 else f"exit status {code}")


_SIGNAL_WORDS = {signal.SIGKILL: "killed", signal.SIGTERM: "terminated", signal.SIGINT: "interrupt",
                 signal.SIGHUP: "hangup", signal.SIGPIPE: "broken pipe"}


def _as_message(event: ExecEvent) -> wire.ProcessEventMessage:
    if event.kind == "started":
        return wire.ProcessEventMessage(event=wire.ProcessEvent(start=wire.StartEvent(pid=event.pid or 0)))
    if event.kind == "exit":
        return wire.ProcessEventMessage(event=wire.ProcessEvent(end=_end_event(event)))
    data = wire.DataEvent(**{event.kind: wire.encode_bytes(event.data)})
    return wire.ProcessEventMessage(event=wire.ProcessEvent(data=data))


Item = TypeVar("Item")


async def _with_keepalives(events: AsyncIterator[Item], timeout: float | None) -> AsyncIterator[Item | None]:
    """A stream's items, and None whenever it has been quiet a while (time for a keepalive:
    proxies and clients drop silent streams), until the call's timeout ends the stream (as
    envd does; a process goes on, to be reached again with Connect). A pump task reads the
    items, so that waiting for the next one never cancels the read itself."""
    queue: asyncio.Queue[Item | BaseException | None] = asyncio.Queue()
    deadline = None if timeout is None else time.monotonic() + timeout

    async def pump() -> None:
        try:
            async for item in events:
                await queue.put(item)
            await queue.put(None)
        except Exception as error:  # handed over, to be raised in the stream
            await queue.put(error)

    task = asyncio.create_task(pump())
    try:
        while True:
            wait = KEEPALIVE_S if deadline is None else min(KEEPALIVE_S, deadline - time.monotonic())
            if wait <= 0:
                raise ConnectError("deadline_exceeded", f"the call's timeout of {timeout:g} s passed")
            try:
                item = await asyncio.wait_for(queue.get(), wait)
            except asyncio.TimeoutError:
                if deadline is None or time.monotonic() < deadline:
                    yield None
                continue
            if item is None:
                return
            if isinstance(item, BaseException):
                raise item
            yield item
    finally:
        task.cancel()
        with contextlib.suppress(BaseException):
            await task


async def _process_stream(events: AsyncIterator[ExecEvent], timeout: float | None) -> AsyncIterator[wire.ProcessEventMessage]:
    async for item in _with_keepalives(events, timeout):
        if item is None:
            yield wire.ProcessEventMessage(event=wire.ProcessEvent(keepalive=wire.Empty()))
        else:
            yield _as_message(item)


async def _pid(target: Target, selector: wire.ProcessSelector) -> int:
    """The process a selector names: its pid, or the pid of the running process with its tag."""
    if selector.pid is not None:
        return selector.pid
    if not selector.tag:
        raise ConnectError("invalid_argument", "process: give a pid or a tag")
    listed = await target.machines.process_op(target.account, target.machine, "processes")
    for process in listed["processes"]:
        if process.get("tag") == selector.tag:
            return int(process["pid"])
    raise ConnectError("not_found", f"process with tag {selector.tag} not found")


async def _process_op(target: Target, op: str, selector: wire.ProcessSelector, **fields: Any) -> None:
    pid = await _pid(target, selector)
    try:
        await target.machines.process_op(target.account, target.machine, op, pid=pid, **fields)
    except NotFound:
        raise ConnectError("not_found", f"process with pid {pid} not found") from None


@router.post("/process.Process/Start")
async def process_start(request: Request) -> Response:
    target = await _target(request)
    message: wire.StartRequest = await _single_message(request, wire.StartRequest)
    pty = message.pty.size if message.pty is not None else None
    user = user_of(request)
    cwd = message.process.cwd
    run = ExecRequest(
        argv=[message.process.cmd, *message.process.args],
        env={**target.env, **message.process.envs},
        cwd=_absolute(cwd, user) if cwd else None,  # none: the user's home
        user=user,
        keep_stdin=True if message.stdin is None else message.stdin,
        tag=message.tag or None,
        pty=None if pty is None else pty.window(),
    )
    events = target.machines.run_process(target.account, target.machine, run)
    # The first event (started, or the error that kept it from starting) comes before
    # the answer does: a command that cannot start is a plain error, not a stream.
    first = await _first(events)
    return server_stream(lambda: _process_stream(_chain(first, events), _timeout_of(request)))


async def _first(events: AsyncIterator[ExecEvent]) -> ExecEvent:
    try:
        return await anext(events)
    except BoxdError as error:
        raise ConnectError.of(error) from None


async def _chain(first: ExecEvent, rest: AsyncIterator[ExecEvent]) -> AsyncIterator[ExecEvent]:
    yield first
    async for item in rest:
        yield item


@router.post("/process.Process/Connect")
async def process_connect(request: Request) -> Response:
    target = await _target(request)
    message: wire.ConnectRequest = await _single_message(request, wire.ConnectRequest)
    pid = await _pid(target, message.process)
    events = target.machines.follow_process(target.account, target.machine, pid)
    try:
        first = await _first(events)
    except ConnectError as error:
        if error.code == "not_found":
            raise ConnectError("not_found", f"process with pid {pid} not found") from None
        raise
    return server_stream(lambda: _process_stream(_chain(first, events), _timeout_of(request)))


@router.post("/process.Process/List")
async def process_list(request: Request) -> Response:
    async def handle(_: wire.ListRequest) -> wire.ListResponse:
        target = await _target(request)
        listed = await target.machines.process_op(target.account, target.machine, "processes")
        return wire.ListResponse(processes=[
            wire.ProcessInfo(
                config=wire.ProcessConfig(cmd=p["argv"][0], args=p["argv"][1:], envs=p.get("env") or {}, cwd=p.get("cwd")),
                pid=p["pid"], tag=p.get("tag"),
            )
            for p in listed["processes"]
        ])

    return await unary(request, wire.ListRequest, handle)


@router.post("/process.Process/SendInput")
async def process_send_input(request: Request) -> Response:
    async def handle(message: wire.SendInputRequest) -> wire.Empty:
        target = await _target(request)
        data = message.input.data()
        await _process_op(target, "stdin", message.process, data=wire.encode_bytes(data))
        return wire.Empty()

    return await unary(request, wire.SendInputRequest, handle)


@router.post("/process.Process/StreamInput")
async def process_stream_input(request: Request) -> Response:
    """Client streaming: a start naming the process, then input, each sent on as it comes."""
    try:
        target = await _target(request)
        selector: wire.ProcessSelector | None = None
        async for data in read_envelopes(request):
            message = parse_message(wire.StreamInputRequest, data)
            if message.start is not None:
                selector = message.start.process
            elif message.data is not None:
                if selector is None:
                    raise ConnectError("invalid_argument", "input came before the start naming the process")
                chunk = message.data.input.data()
                await _process_op(target, "stdin", selector, data=wire.encode_bytes(chunk))
        ending: dict[str, Any] = {}
        answer = [wire.Empty()]
    except BoxdError as error:
        ending, answer = {"error": ConnectError.of(error).to_dict()}, []
    except ConnectError as error:
        ending, answer = {"error": error.to_dict()}, []

    async def events() -> AsyncIterator[wire.Empty]:
        for item in answer:
            yield item
        if ending:
            raise ConnectError(ending["error"]["code"], ending["error"]["message"])

    return server_stream(events)


@router.post("/process.Process/CloseStdin")
async def process_close_stdin(request: Request) -> Response:
    async def handle(message: wire.CloseStdinRequest) -> wire.Empty:
        await _process_op(await _target(request), "close_stdin", message.process)
        return wire.Empty()

    return await unary(request, wire.CloseStdinRequest, handle)


@router.post("/process.Process/SendSignal")
async def process_send_signal(request: Request) -> Response:
    async def handle(message: wire.SendSignalRequest) -> wire.Empty:
        if message.signal is wire.Signal.SIGNAL_UNSPECIFIED:
            raise ConnectError("invalid_argument", "signal: SIGNAL_SIGTERM or SIGNAL_SIGKILL")
        await _process_op(await _target(request), "signal", message.process, signal=int(message.signal))
        return wire.Empty()

    return await unary(request, wire.SendSignalRequest, handle)


@router.post("/process.Process/Update")
async def process_update(request: Request) -> Response:
    async def handle(message: wire.UpdateRequest) -> wire.Empty:
        if message.pty is not None:
            await _process_op(await _target(request), "resize", message.process, pty=message.pty.size.window())
        return wire.Empty()

    return await unary(request, wire.UpdateRequest, handle)


# -- filesystem ---------------------------------------------------------------------------


def _absolute(path: str, user: str) -> str:
    """envd resolves relative paths (and ~) against the user's home."""
    home = "/root" if user == "root" else f"/home/{user}"
    if path.startswith("~"):
        path = home + path[1:]
    return posixpath.normpath(posixpath.join(home, path))


async def _entry(target: Target, path: str, **stat_fields: Any) -> wire.EntryInfo:
    return wire.EntryInfo.of((await _fs(target, "stat", path=path, **stat_fields))["entry"])


async def _fs(target: Target, op: str, **fields: Any) -> dict[str, Any]:
    """One of the agent's file operations; its errors become Connect's by their code."""
    return await target.machines.fs_op(target.account, target.machine, op, **fields)


@router.post("/filesystem.Filesystem/Stat")
async def fs_stat(request: Request) -> Response:
    async def handle(message: wire.PathRequest) -> wire.EntryMessage:
        target = await _target(request)
        return wire.EntryMessage(entry=await _entry(target, _absolute(message.path, user_of(request))))

    return await unary(request, wire.PathRequest, handle)


@router.post("/filesystem.Filesystem/MakeDir")
async def fs_make_dir(request: Request) -> Response:
    async def handle(message: wire.PathRequest) -> wire.EntryMessage:
        target, user = await _target(request), user_of(request)
        path = _absolute(message.path, user)
        made = await _fs(target, "make_dir", path=path, user=user)
        if not made.get("created"):
            raise ConnectError("already_exists", f"directory {path} already exists")
        return wire.EntryMessage(entry=await _entry(target, path))

    return await unary(request, wire.PathRequest, handle)


@router.post("/filesystem.Filesystem/Move")
async def fs_move(request: Request) -> Response:
    async def handle(message: wire.MoveRequest) -> wire.EntryMessage:
        target, user = await _target(request), user_of(request)
        destination = _absolute(message.destination, user)
        await _fs(target, "move", path=_absolute(message.source, user), destination=destination)
        return wire.EntryMessage(entry=await _entry(target, destination))

    return await unary(request, wire.MoveRequest, handle)


@router.post("/filesystem.Filesystem/ListDir")
async def fs_list_dir(request: Request) -> Response:
    async def handle(message: wire.ListDirRequest) -> wire.ListDirResponse:
        target = await _target(request)
        path = _absolute(message.path, user_of(request))
        listed = await _fs(target, "list_dir", path=path, depth=message.depth or 1)
        return wire.ListDirResponse(entries=[wire.EntryInfo.of(entry) for entry in listed["entries"]])

    return await unary(request, wire.ListDirRequest, handle)


@router.post("/filesystem.Filesystem/Remove")
async def fs_remove(request: Request) -> Response:
    async def handle(message: wire.PathRequest) -> wire.Empty:
        await _fs(await _target(request), "remove", path=_absolute(message.path, user_of(request)))
        return wire.Empty()

    return await unary(request, wire.PathRequest, handle)


# -- envd's HTTP API ----------------------------------------------------------------------


@router.get("/health")
async def health(request: Request) -> Response:
    """204 while the sandbox runs; a paused or gone one answers as E2B's proxy does (502,
    "... was not found"), which the SDKs read as not running."""
    target = await _target(request)
    if target.machines.state_of(target.account, target.machine) in (MachineState.PAUSED, MachineState.STOPPED):
        raise Unreachable(f"The sandbox {target.machine} was not found: it is paused")
    return Response(status_code=204)


async def _written(target: Target, path: str, metadata: dict[str, str]) -> dict[str, Any]:
    """What an upload answers of a file it wrote, after giving it its metadata. A file
    written without metadata has none: each upload makes a new file (the agent's write)."""
    info: dict[str, Any] = {"name": posixpath.basename(path), "type": "file", "path": path}
    if metadata:
        kept = (await _entry(target, path, set_metadata=metadata)).metadata
        if kept:  # none where the guest's filesystem keeps no extended attributes
            info["metadata"] = kept
    return info


def _metadata_of(request: Request) -> dict[str, str]:
    try:
        return wire.upload_metadata(request.headers.items())
    except ValueError as error:
        raise InvalidInput(f"invalid metadata: {error}", field="metadata") from None


async def _octets(request: Request) -> AsyncIterator[bytes]:
    """The upload's bytes, gunzipped on the way if it came gzip-encoded."""
    if request.headers.get("content-encoding", "").lower() != "gzip":
        async for chunk in request.stream():
            yield chunk
        return
    inflater = zlib.decompressobj(wbits=31)
    async for chunk in request.stream():
        try:
            yield inflater.decompress(chunk)
        except zlib.error as error:
            raise InvalidInput(f"body: not valid gzip: {error}", field="body") from None
    yield inflater.flush()


async def _spooled(upload: UploadFile) -> AsyncIterator[bytes]:
    while chunk := await upload.read(UPLOAD_CHUNK):
        yield chunk


@router.post("/files")
async def upload_files(request: Request, path: str | None = None) -> Response:
    """One file as the body (``application/octet-stream``, ``path`` in the query), or a
    multipart form of ``file`` parts each named by its path."""
    target, user = await _file_target(request, signing.WRITE), user_of(request)
    machines = target.machines
    metadata = _metadata_of(request)  # refused before anything is written
    if request.headers.get("content-type", "").startswith("multipart/form-data"):
        form = await request.form(max_files=10_000)
        uploads = [part for part in form.getlist("file") if isinstance(part, UploadFile)]
        if not uploads:
            raise InvalidInput("file: the form holds no file part", field="file")
        written = []
        for upload in uploads:
            where = path if path and len(uploads) == 1 else upload.filename
            if not where:
                raise InvalidInput("path: give it in the query or as each part's file name", field="path")
            destination = _absolute(where, user)
            await machines.write_file(target.account, target.machine, destination, _spooled(upload),
                                      mode=None, user=user)
            written.append(await _written(target, destination, metadata))
        return JSONResponse(written)
    if not path:
        raise InvalidInput("path: the query parameter naming the file is missing", field="path")
    destination = _absolute(path, user)
    await machines.write_file(target.account, target.machine, destination, _octets(request), mode=None, user=user)
    return JSONResponse([await _written(target, destination, metadata)])


@router.get("/files")
async def download_file(request: Request, path: str) -> Response:
    target, user = await _file_target(request, signing.READ), user_of(request)
    chunks = target.machines.read_file(target.account, target.machine, _absolute(path, user))
    # The first chunk comes before the answer: a missing file is a 404, not a cut stream.
    try:
        first = await anext(chunks)
    except StopAsyncIteration:
        first = b""
    except NotFound:
        raise NotFound(f"path '{path}' does not exist", field="path") from None

    async def body() -> AsyncIterator[bytes]:
        yield first
        async for chunk in chunks:
            yield chunk

    return StreamingResponse(body(), media_type="application/octet-stream")


# -- directory watches --------------------------------------------------------------------

_EVENT_TYPES = {"create": wire.EventType.CREATE, "write": wire.EventType.WRITE, "remove": wire.EventType.REMOVE,
                "rename": wire.EventType.RENAME, "chmod": wire.EventType.CHMOD}
_EVENTS_WITH_ENTRY = frozenset({wire.EventType.CREATE, wire.EventType.WRITE, wire.EventType.CHMOD})


async def _watch(target: Target, path: str, recursive: bool, include_entry: bool) -> AsyncIterator[wire.FilesystemEvent]:
    """A folder's changes from the moment the guest watches it. A folder it cannot watch
    (missing, or a file) raises here, so that the error is the answer and no start is sent."""
    watching = target.machines.watch_dir(target.account, target.machine, path, recursive=recursive)
    await anext(watching)  # WATCH_STARTED
    return _changes(target, path, watching, include_entry)


async def _changes(
    target: Target, path: str, watching: AsyncIterator[tuple[str, str]], include_entry: bool
) -> AsyncIterator[wire.FilesystemEvent]:
    async for name, kind in watching:
        event = wire.FilesystemEvent(name=name, type=_EVENT_TYPES[kind])
        # As envd: only what still names the entry carries it (a remove or rename leaves
        # the path empty, or to something else), and only if it can be described.
        if include_entry and event.type in _EVENTS_WITH_ENTRY:
            with contextlib.suppress(BoxdError):
                event.entry = await _entry(target, posixpath.join(path, name))
        yield event


class Watchers:
    """The watches of the SDK's sync API: made by CreateWatcher, drained by GetWatcherEvents,
    ended by RemoveWatcher (or with their sandbox's envd connection)."""

    def __init__(self) -> None:
        self._events: dict[str, list[wire.FilesystemEvent]] = {}
        self._tasks: dict[str, asyncio.Task] = {}
        self._owners: dict[str, str] = {}

    async def create(self, target: Target, path: str, recursive: bool, include_entry: bool) -> str:
        changes = await _watch(target, path, recursive, include_entry)
        watcher_id = secrets.token_hex(8)
        self._events[watcher_id] = []
        self._owners[watcher_id] = target.machine
        self._tasks[watcher_id] = asyncio.create_task(self._collect(watcher_id, changes))
        return watcher_id

    async def _collect(self, watcher_id: str, changes: AsyncIterator[wire.FilesystemEvent]) -> None:
        with contextlib.suppress(BoxdError):
            async for change in changes:
                self._events[watcher_id].append(change)

    def _check(self, target: Target, watcher_id: str) -> None:
        if self._owners.get(watcher_id) != target.machine:
            raise ConnectError("not_found", f"watcher {watcher_id} not found")

    def drain(self, target: Target, watcher_id: str) -> list[wire.FilesystemEvent]:
        self._check(target, watcher_id)
        events, self._events[watcher_id] = self._events[watcher_id], []
        return events

    async def remove(self, target: Target, watcher_id: str) -> None:
        self._check(target, watcher_id)
        task = self._tasks.pop(watcher_id)
        self._events.pop(watcher_id, None)
        self._owners.pop(watcher_id, None)
        task.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await task

    async def close(self) -> None:
        for task in self._tasks.values():
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)


def _watchers(request: Request) -> Watchers:
    return request.app.state.watchers


@router.post("/filesystem.Filesystem/WatchDir")
async def fs_watch_dir(request: Request) -> Response:
    target = await _target(request)
    message: wire.WatchDirRequest = await _single_message(request, wire.WatchDirRequest)
    path = _absolute(message.path, user_of(request))
    changes = await _watch(target, path, message.recursive, message.include_entry)
    timeout = _timeout_of(request)

    async def events() -> AsyncIterator[wire.WatchDirResponse]:
        yield wire.WatchDirResponse(start=wire.Empty())
        async for item in _with_keepalives(changes, timeout):
            if item is None:
                yield wire.WatchDirResponse(keepalive=wire.Empty())
            else:
                yield wire.WatchDirResponse(filesystem=item)

    return server_stream(events)


@router.post("/filesystem.Filesystem/CreateWatcher")
async def fs_create_watcher(request: Request) -> Response:
    async def handle(message: wire.WatchDirRequest) -> wire.CreateWatcherResponse:
        target = await _target(request)
        path = _absolute(message.path, user_of(request))
        watcher_id = await _watchers(request).create(target, path, message.recursive, message.include_entry)
        return wire.CreateWatcherResponse(watcher_id=watcher_id)

    return await unary(request, wire.WatchDirRequest, handle)


@router.post("/filesystem.Filesystem/GetWatcherEvents")
async def fs_get_watcher_events(request: Request) -> Response:
    async def handle(message: wire.WatcherRequest) -> wire.GetWatcherEventsResponse:
        target = await _target(request)
        return wire.GetWatcherEventsResponse(events=_watchers(request).drain(target, message.watcher_id))

    return await unary(request, wire.WatcherRequest, handle)


@router.post("/filesystem.Filesystem/RemoveWatcher")
async def fs_remove_watcher(request: Request) -> Response:
    async def handle(message: wire.WatcherRequest) -> wire.Empty:
        await _watchers(request).remove(await _target(request), message.watcher_id)
        return wire.Empty()

    return await unary(request, wire.WatcherRequest, handle)
