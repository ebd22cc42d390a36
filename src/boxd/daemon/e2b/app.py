"""The E2B application, mounted under ``/e2b`` of the daemon, with E2B's error shapes:
``{"code": <HTTP status>, "message"}`` for the REST calls, Connect's
``{"code": "<name>", "message"}`` for envd's RPCs."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from boxd.daemon.auth import Keys
from boxd.daemon.e2b import control, envd
from boxd.daemon.e2b.connect import ConnectError, unary_error
from boxd.daemon.e2b.metrics import MetricsSampler
from boxd.daemon.e2b.service import SandboxService
from boxd.daemon.logs import event
from boxd.errors import BoxdError

log = logging.getLogger(__name__)

_RPC_PREFIXES = ("/process.Process/", "/filesystem.Filesystem/")
_CONNECT_CODE_OF_STATUS = {400: "invalid_argument", 401: "unauthenticated", 404: "unimplemented",
                           405: "unimplemented", 415: "invalid_argument"}


def _is_rpc(request: Request) -> bool:
    return request.scope["path"].removeprefix(request.scope.get("root_path", "")).startswith(_RPC_PREFIXES)


def _answer(request: Request, status: int, connect_code: str, message: str) -> JSONResponse:
    """An RPC's error is Connect's (its status follows from its code); any other is E2B's."""
    if _is_rpc(request):
        return unary_error(ConnectError(connect_code, message))
    # Retrying would not help, and e2b 2.63 retries 429 and 5xx with backoff unless told.
    headers = {"Should-Retry": "false"} if status == 429 or status >= 500 else None
    return JSONResponse({"code": status, "message": message}, status_code=status, headers=headers)


async def _boxd_error(request: Request, error: BoxdError) -> JSONResponse:
    event(log, "e2b.error", level=logging.INFO if error.status < 500 else logging.ERROR,
          path=request.url.path, code=error.code, message=error.message)
    # E2B answers bad input with 400, where boxd says 422.
    status = 400 if error.status == 422 else error.status
    return _answer(request, status, ConnectError.of(error).code, error.message)


async def _connect_error(request: Request, error: ConnectError) -> JSONResponse:
    return unary_error(error)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    first = error.errors()[0]
    field = ".".join(str(part) for part in first.get("loc", ())[1:]) or "body"
    message = f"{field}: {str(first.get('msg', 'invalid value')).removeprefix('Value error, ')}"
    return _answer(request, 400, "invalid_argument", message)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    status = error.status_code
    message = str(error.detail)
    if status in (404, 405):
        message = f"{request.method} {request.url.path}: not supported by boxd's E2B API"
    return _answer(request, status, _CONNECT_CODE_OF_STATUS.get(status, "unknown"), message)


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _answer(request, 500, "internal", f"internal error: {type(error).__name__}")


class FileURLsAtRoot:
    """The SDKs build file URLs (``download_url``, ``upload_url``) as
    ``urljoin(E2B_SANDBOX_URL, "/files")``, which drops E2B_SANDBOX_URL's own path: so the
    daemon's ``/files`` is envd's, as ``<prefix>/files`` is."""

    def __init__(self, app: ASGIApp, prefix: str) -> None:
        self.app = app
        self.path = f"{prefix}/files"

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and scope["path"] == "/files":
            scope = {**scope, "path": self.path, "raw_path": self.path.encode()}
        await self.app(scope, receive, send)


def create_e2b_app(
    *, keys: Keys, sandboxes: SandboxService, watchers: envd.Watchers, metrics: MetricsSampler
) -> FastAPI:
    app = FastAPI(title="boxd: E2B-compatible API", openapi_url=None, docs_url=None, redoc_url=None)
    app.state.keys = keys
    app.state.sandboxes = sandboxes
    app.state.watchers = watchers
    app.state.metrics = metrics
    app.include_router(control.router)
    app.include_router(envd.router)
    app.add_exception_handler(BoxdError, _boxd_error)
    app.add_exception_handler(ConnectError, _connect_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    return app
