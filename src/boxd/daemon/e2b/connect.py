"""The Connect protocol (connectrpc.com/docs/protocol) with its JSON codec, as envd speaks it.

Unary calls are a JSON body in and out, an error being a non-200 status with
``{"code", "message"}``. Streams (``application/connect+json``) are envelopes: one flag
byte, a 4-byte big-endian length, a JSON message; the last envelope has flag 0x02 and
holds ``{}`` or ``{"error": {...}}``, and the HTTP status is 200 even for an error.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import struct
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from pydantic import BaseModel, ValidationError
from starlette.types import Receive, Scope, Send

from boxd.errors import BoxdError

log = logging.getLogger(__name__)

END_STREAM = 0x02
COMPRESSED = 0x01
MAX_MESSAGE = 16 * 1024 * 1024
STREAM_MEDIA_TYPE = "application/connect+json"

# Connect's codes and the HTTP status a unary error carries with each.
STATUS_OF_CODE = {
    "canceled": 499,
    "unknown": 500,
    "invalid_argument": 400,
    "deadline_exceeded": 504,
    "not_found": 404,
    "already_exists": 409,
    "permission_denied": 403,
    "resource_exhausted": 429,
    "failed_precondition": 400,
    "aborted": 409,
    "out_of_range": 400,
    "unimplemented": 501,
    "internal": 500,
    "unavailable": 503,
    "data_loss": 500,
    "unauthenticated": 401,
}

# boxd's error codes (never their wording) and the Connect code each becomes.
CODE_OF_BOXD_CODE = {
    "invalid_input": "invalid_argument",
    "not_found": "not_found",
    "conflict": "failed_precondition",
    "quota_exceeded": "resource_exhausted",
    "forbidden": "permission_denied",
    "too_large": "resource_exhausted",
    "unauthorized": "unauthenticated",
    "timeout": "deadline_exceeded",
    "unsupported": "unimplemented",
    "agent_unavailable": "unavailable",
    "bad_gateway": "unavailable",
    "daemon_unavailable": "unavailable",
}


# boxd codes that mean a stream's sandbox went away under it (killed, paused to disk):
# E2B's proxy then cuts the stream's connection, and the SDKs ask /health to tell a
# sandbox that is gone ("killed or reached its end of life") from a network failure.
CODES_OF_A_LOST_SANDBOX = frozenset({"agent_unavailable"})


class ConnectError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        assert code in STATUS_OF_CODE, code
        self.code = code
        self.message = message

    @classmethod
    def of(cls, error: BoxdError) -> "ConnectError":
        return cls(CODE_OF_BOXD_CODE.get(error.code, "internal"), error.message)

    def to_dict(self) -> dict[str, str]:
        return {"code": self.code, "message": self.message}


Message = TypeVar("Message", bound=BaseModel)


def envelope(payload: dict[str, Any], flags: int = 0) -> bytes:
    data = json.dumps(payload, separators=(",", ":")).encode()
    return struct.pack(">BI", flags, len(data)) + data


def parse_message(model: type[Message], data: bytes) -> Message:
    try:
        return model.model_validate_json(data or b"{}")
    except ValidationError as error:
        first = error.errors()[0]
        where = ".".join(str(part) for part in first.get("loc", ())) or "message"
        raise ConnectError("invalid_argument", f"{where}: {first.get('msg')}") from None


async def read_envelopes(request: Request) -> AsyncIterator[bytes]:
    """The messages of a streamed request body, each as it arrives whole."""
    buffer = b""
    async for chunk in request.stream():
        buffer += chunk
        while len(buffer) >= 5:
            flags, length = struct.unpack(">BI", buffer[:5])
            if length > MAX_MESSAGE:
                raise ConnectError("resource_exhausted", f"a message of {length} bytes is over {MAX_MESSAGE}")
            if len(buffer) < 5 + length:
                break
            data, buffer = buffer[5 : 5 + length], buffer[5 + length :]
            if flags & COMPRESSED:
                raise ConnectError("internal", "compressed messages are not supported")
            if flags & END_STREAM:
                return
            yield data
    if buffer:
        raise ConnectError("invalid_argument", "the request stream ended inside a message")


def unary_error(error: ConnectError) -> JSONResponse:
    return JSONResponse(error.to_dict(), status_code=STATUS_OF_CODE[error.code])


async def unary(request: Request, model: type[Message], handle: Callable[[Message], Awaitable[BaseModel]]) -> Response:
    try:
        message = parse_message(model, await request.body())
        answer = await handle(message)
    except BoxdError as error:
        return unary_error(ConnectError.of(error))
    except ConnectError as error:
        return unary_error(error)
    return JSONResponse(answer.model_dump(by_alias=True, exclude_none=True))


class _Cut(Exception):
    """Ends a stream without its end message: its connection is reset instead."""


class _CuttableStream(StreamingResponse):
    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope = scope
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        try:
            await super().stream_response(send)
        except _Cut:
            # Left unfinished, the response makes the server close the connection.
            reset_when_closed(self._scope)


def reset_when_closed(scope: Scope) -> None:
    """Have the kernel reset a request's TCP connection when the server closes it
    (SO_LINGER 0), as E2B's proxy resets the stream of a sandbox that died. ASGI has no
    way to reset a connection, and a plain close (FIN) halfway through a chunked body is
    a protocol error to the SDKs, not the dropped connection after which they ask
    /health. The socket is found among this process's by its two addresses; a
    connection over the unix socket has no client address and is closed plainly."""
    client, server = scope.get("client"), scope.get("server")
    if not client or not server:
        return
    for fd in os.listdir("/proc/self/fd"):
        try:
            if not os.readlink(f"/proc/self/fd/{fd}").startswith("socket:"):
                continue
            # A duplicate: closing it leaves the connection open, and options are shared.
            with socket.socket(fileno=os.dup(int(fd))) as candidate:
                if (candidate.getsockname()[:2], candidate.getpeername()[:2]) == (tuple(server), tuple(client)):
                    candidate.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                    return
        except OSError:  # gone meanwhile, not connected, or no address of that kind
            continue


def server_stream(events: Callable[[], AsyncIterator[BaseModel]]) -> StreamingResponse:
    """Answer with the messages ``events`` yields, then the end of the stream (with the
    error that ended it, if one did), or cut it if its sandbox went away. Starlette
    cancels the iteration when the client goes."""

    async def body() -> AsyncIterator[bytes]:
        ending: dict[str, Any] = {}
        try:
            async for message in events():
                yield envelope(message.model_dump(by_alias=True, exclude_none=True))
        except BoxdError as error:
            if error.code in CODES_OF_A_LOST_SANDBOX:
                log.info("envd stream cut, its sandbox went away: %s", error.code)
                raise _Cut from error
            ending = {"error": ConnectError.of(error).to_dict()}
        except ConnectError as error:
            ending = {"error": error.to_dict()}
        except Exception as error:  # the stream has begun: the end message is the only way to tell
            log.exception("envd stream failed")
            ending = {"error": {"code": "internal", "message": f"internal error: {type(error).__name__}"}}
        yield envelope(ending, END_STREAM)

    return _CuttableStream(body(), media_type=STREAM_MEDIA_TYPE)
