"""Machine URLs: ``http://NAME.localhost:PORT/`` answers from port ``http_port`` in the machine.

The daemon serves them on its own port, next to the API, telling them apart by the
Host header. A request needs the account's key (``Authorization: Bearer``), which is
not passed on to the machine, unless the machine is public; a public machine is found by
its id, or by its name when no other public machine has that name. A request wakes a
suspended or hibernated machine and counts as activity, like any use of it.

The daemon reaches the machine through a port on the host's 127.0.0.1 that the
machine's own network process forwards to the guest (machines themselves never reach
the host's loopback). A restore keeps that port; a fork gets its own.
"""

from __future__ import annotations

import http.cookiejar
import re
from collections.abc import AsyncIterator

import httpx
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import ASGIApp, Receive, Scope, Send

from boxd.daemon.auth import Keys
from boxd.daemon.machines import MachineService
from boxd.daemon.store import Store
from boxd.errors import AuthError, BoxdError, NotFound, Unreachable

MACHINE_HOST = re.compile(r"^(?P<label>[a-z0-9](?:[a-z0-9-]{0,61}[a-z0-9])?)\.localhost(?::\d+)?$")
# Meaningful for one connection only, or boxd's own: never passed through.
_HOP_BY_HOP = {
    b"connection", b"keep-alive", b"proxy-authenticate", b"proxy-authorization", b"te", b"trailer",
    b"transfer-encoding", b"upgrade", b"host",
}


def _passed_on(raw_headers: list[tuple[bytes, bytes]], *, drop: frozenset[bytes] = frozenset()) -> list[tuple[bytes, bytes]]:
    """Every header but the hop-by-hop ones (and ``drop``), repeated ones (Set-Cookie) kept apart."""
    return [(name, value) for name, value in raw_headers if name.lower() not in _HOP_BY_HOP | drop]


class MachineURLs:
    """ASGI middleware: requests for a machine's host name go to the machine, the rest to the API."""

    def __init__(
        self, app: ASGIApp, *, store: Store, keys: Keys, machines: MachineService, client: httpx.AsyncClient
    ) -> None:
        self.app = app
        self._store = store
        self._keys = keys
        self._machines = machines
        self._client = client

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        host = dict(scope.get("headers") or []).get(b"host", b"").decode("latin-1").lower()
        match = MACHINE_HOST.match(host) if scope["type"] == "http" else None
        if match is None:
            await self.app(scope, receive, send)
            return
        try:
            response = await self._forward(Request(scope, receive), match["label"])
        except BoxdError as error:
            response = JSONResponse({"error": error.to_dict()}, status_code=error.status)
        await response(scope, receive, send)

    def _machine_for(self, request: Request, label: str):
        """The account and machine a request is for. An Authorization header that is not a
        boxd key belongs to the machine's app, and is passed on to it."""
        authorization = request.headers.get("authorization")
        not_yours = None
        if self._keys.is_boxd_key(authorization):
            account = self._keys.account_of(authorization)
            try:
                return account, self._store.find_machine(account, label)
            except NotFound as error:
                not_yours = error  # another account's machine may still be public
        try:
            machine = self._store.find_public_machine(label)
        except NotFound:
            if not_yours is not None:
                raise not_yours from None
            # Not found and not public look the same: a URL does not tell who has what.
            raise AuthError(
                f"{label}.localhost: send the account's key (Authorization: Bearer <key>), "
                "or make the machine public"
            ) from None
        return self._store.account_of(machine.id), machine

    async def _forward(self, request: Request, label: str) -> Response:
        account, machine = self._machine_for(request, label)
        machine = await self._machines.usable(account, machine.id)
        info = await self._machines.runtime.info(machine.id)
        if info.url_port is None:
            raise Unreachable(f"machine {machine.name} has no URL port (it was made before machines had URLs)")
        # The request target as it came (a decoded path would turn %3F into a query, %2F
        # into a slash), and no "?" when there is no query.
        query = request.scope.get("query_string", b"")
        raw_target = request.scope.get("raw_path") or request.url.path.encode()
        target = httpx.URL(f"http://127.0.0.1:{info.url_port}").copy_with(
            raw_path=raw_target + (b"?" + query if query else b"")
        )
        # No body, none passed on: a stream would go as an empty chunked body, even on a GET.
        has_body = "content-length" in request.headers or "transfer-encoding" in request.headers
        upstream_request = self._client.build_request(
            request.method, target,
            headers=_passed_on(
                request.headers.raw,
                drop=frozenset({b"authorization"}) if self._keys.is_boxd_key(request.headers.get("authorization")) else frozenset(),
            ),
            content=request.stream() if has_body else None,
        )
        activity = self._machines.activity
        activity.begin(machine.id)  # until the whole answer has been passed on
        try:
            upstream = await self._client.send(upstream_request, stream=True)
        except httpx.TransportError as error:
            activity.end(machine.id)
            raise Unreachable(
                f"machine {machine.name}: nothing answered on port {machine.http_port} ({type(error).__name__})",
                machine=machine.id,
            ) from None

        async def body() -> AsyncIterator[bytes]:
            try:
                async for chunk in upstream.aiter_raw():
                    yield chunk
            finally:
                await upstream.aclose()
                activity.end(machine.id)

        response = StreamingResponse(body(), status_code=upstream.status_code)
        response.raw_headers = _passed_on(upstream.headers.raw)
        return response


def proxy_client() -> httpx.AsyncClient:
    # No read timeout: a machine's app may stream for as long as it likes. No cookie jar:
    # a cookie belongs to the browser it was set for, never to the next visitor (nor to
    # the next machine, since every machine's app is on 127.0.0.1).
    no_cookies = http.cookiejar.CookieJar(http.cookiejar.DefaultCookiePolicy(allowed_domains=[]))
    return httpx.AsyncClient(timeout=httpx.Timeout(10.0, read=None), follow_redirects=False, cookies=no_cookies)
