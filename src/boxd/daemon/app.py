"""The FastAPI application: routes, the error shape, request logs.

Every error answer is ``{"error": {"code", "message", "field"?, "details"?}}`` with the
status of the ``BoxdError`` class behind it; validation errors become ``invalid_input``
naming the field, so a client never has to read FastAPI's own error format.
"""

from __future__ import annotations

import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from boxd import __version__
from boxd.daemon.auth import Keys
from boxd.daemon.e2b.app import FileURLsAtRoot, create_e2b_app
from boxd.daemon.e2b.envd import Watchers
from boxd.daemon.e2b.metrics import MetricsSampler
from boxd.daemon.e2b.service import SandboxService
from boxd.daemon.logs import event
from boxd.daemon.machines import MachineService
from boxd.daemon.routes import admin, health
from boxd.daemon.routes import machines as machine_routes
from boxd.daemon.routes import snapshots as snapshot_routes
from boxd.daemon.snapshots import SnapshotService
from boxd.daemon.urls import MachineURLs, proxy_client
from boxd.daemon.store import Store
from boxd.errors import BoxdError
from boxd.models import ErrorBody

log = logging.getLogger(__name__)

# Starlette's own errors: routes that do not exist, methods a route does not take.
_CODE_BY_STATUS = {404: "not_found", 405: "method_not_allowed"}
# Where the E2B-compatible API is served: E2B_API_URL and E2B_SANDBOX_URL point here.
E2B_PREFIX = "/e2b"


def _error_response(status: int, body: dict[str, Any]) -> JSONResponse:
    return JSONResponse({"error": body}, status_code=status)


async def _boxd_error(request: Request, error: BoxdError) -> JSONResponse:
    event(log, "http.error", level=logging.INFO if error.status < 500 else logging.ERROR,
          path=request.url.path, code=error.code, message=error.message)
    return _error_response(error.status, error.to_dict())


def _field_of(location: tuple[Any, ...]) -> str:
    # ("body", "name") -> "name"; ("query", "timeout") -> "timeout"; ("body",) -> "body"
    parts = [str(part) for part in location[1:]] or [str(location[0])]
    return ".".join(parts)


async def _validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
    problems = error.errors()
    first = problems[0]
    field = _field_of(tuple(first.get("loc", ("body",))))
    message = str(first.get("msg", "invalid value")).removeprefix("Value error, ")
    details = [{"field": _field_of(tuple(p.get("loc", ()))), "message": p.get("msg")} for p in problems]
    body = {"code": "invalid_input", "message": f"{field}: {message}", "field": field, "details": {"errors": details}}
    return _error_response(422, body)


async def _http_error(request: Request, error: HTTPException) -> JSONResponse:
    code = _CODE_BY_STATUS.get(error.status_code, "http_error")
    return _error_response(error.status_code, {"code": code, "message": str(error.detail)})


async def _unexpected_error(request: Request, error: Exception) -> JSONResponse:
    log.exception("unexpected error on %s %s", request.method, request.url.path)
    return _error_response(500, {"code": "internal", "message": f"internal error: {type(error).__name__}"})


class RequestLog:
    """One log line per request, with its status and duration."""

    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        status = 500

        async def sending(message: Message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, sending)
        finally:
            event(log, "http.request", method=scope["method"], path=scope["path"], status=status,
                  ms=round((time.monotonic() - started) * 1000, 1))


def create_app(*, store: Store, keys: Keys, machines: MachineService, local_socket: str) -> FastAPI:
    snapshots = SnapshotService(store, machines.runtime, machines)
    sandboxes = SandboxService(store, machines, snapshots)
    watchers = Watchers()
    metrics = MetricsSampler(store, machines.runtime)
    url_client = proxy_client()

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        await machines.recover()
        await snapshots.recover()
        machines.start_idle_watch()
        sandboxes.start_expiry_watch()
        metrics.start()
        yield
        await metrics.close()
        await watchers.close()
        await sandboxes.close()
        await snapshots.close()
        await machines.close()
        await url_client.aclose()

    app = FastAPI(
        title="boxd",
        version=__version__,
        summary="Self-hosted microVMs that can be forked while running",
        lifespan=lifespan,
        responses={"default": {"model": ErrorBody, "description": "an error, by code"}},
    )
    app.state.store = store
    app.state.keys = keys
    app.state.machines = machines
    app.state.snapshots = snapshots
    app.state.sandboxes = sandboxes
    app.state.metrics = metrics
    app.state.local_socket = local_socket
    app.include_router(health.router)
    app.include_router(machine_routes.router)
    app.include_router(snapshot_routes.router)
    app.include_router(admin.router)
    app.mount(E2B_PREFIX, create_e2b_app(keys=keys, sandboxes=sandboxes, watchers=watchers, metrics=metrics))
    app.add_exception_handler(BoxdError, _boxd_error)
    app.add_exception_handler(RequestValidationError, _validation_error)
    app.add_exception_handler(HTTPException, _http_error)
    app.add_exception_handler(Exception, _unexpected_error)
    # Inside MachineURLs: a machine's own /files (at its URL) is the machine's.
    app.add_middleware(FileURLsAtRoot, prefix=E2B_PREFIX)
    app.add_middleware(MachineURLs, store=store, keys=keys, machines=machines, client=url_client)
    app.add_middleware(RequestLog)
    return app
