"""What routes get from a request: the caller's account and the daemon's services."""

from __future__ import annotations

from typing import Annotated

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer

from boxd.daemon.auth import Keys
from boxd.daemon.machines import MachineService
from boxd.daemon.snapshots import SnapshotService
from boxd.daemon.store import Store
from boxd.errors import Forbidden

# Declared for the OpenAPI document; the header itself is checked by Keys.account_of so
# that a missing or malformed one gets our 401, not FastAPI's 403.
_bearer = HTTPBearer(auto_error=False, description="an API key: boxd_<48 hex digits>")


def _account(
    request: Request, _: Annotated[HTTPAuthorizationCredentials | None, Depends(_bearer)]
) -> str:
    keys: Keys = request.app.state.keys
    return keys.account_of(request.headers.get("authorization"))


def _machines(request: Request) -> MachineService:
    return request.app.state.machines


def _snapshots(request: Request) -> SnapshotService:
    return request.app.state.snapshots


def _store(request: Request) -> Store:
    return request.app.state.store


def _keys(request: Request) -> Keys:
    return request.app.state.keys


def _local_socket_only(request: Request) -> None:
    """Admin calls are trusted by the socket's file mode (600), so TCP may not make them."""
    server = request.scope.get("server") or (None, None)
    if tuple(server) != (request.app.state.local_socket, None):
        raise Forbidden(f"admin calls are served only on the local socket {request.app.state.local_socket}")


AccountName = Annotated[str, Depends(_account)]
Machines = Annotated[MachineService, Depends(_machines)]
Snapshots = Annotated[SnapshotService, Depends(_snapshots)]
StoreDep = Annotated[Store, Depends(_store)]
KeysDep = Annotated[Keys, Depends(_keys)]
LocalSocketOnly = Depends(_local_socket_only)
