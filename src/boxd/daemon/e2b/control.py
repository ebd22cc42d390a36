"""The E2B control plane: sandboxes (v1 and v2 paths) and snapshots, keyed by ``X-API-KEY``
(a boxd API key, as ``boxd_<hex>`` or as ``e2b_<hex>``, the spelling E2B's SDKs accept)."""

from __future__ import annotations

from datetime import UTC, datetime
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Depends, Query, Request, Response
from fastapi.responses import JSONResponse

from boxd.daemon.auth import E2B_KEY_PREFIX, KEY_PREFIX, Keys, boxd_spelling
from boxd.daemon.e2b import control_wire as wire
from boxd.daemon.e2b.service import SandboxQuery, SandboxService, parse_metadata_filter
from boxd.errors import AuthError, InvalidInput, Unsupported

router = APIRouter()


def _account(request: Request) -> str:
    keys: Keys = request.app.state.keys
    key = boxd_spelling((request.headers.get("x-api-key") or "").strip())
    if key:
        if not key.startswith(KEY_PREFIX):
            raise AuthError(f"X-API-KEY: not a boxd API key ({KEY_PREFIX}... or {E2B_KEY_PREFIX}... with the same "
                            "digits); set E2B_API_KEY to one")
        return keys.account_of(f"Bearer {key}")
    if request.headers.get("authorization"):
        return keys.account_of(request.headers["authorization"])
    raise AuthError("missing API key: send X-API-KEY: <a boxd API key> (the e2b SDK reads E2B_API_KEY)")


def _service(request: Request) -> SandboxService:
    return request.app.state.sandboxes


Account = Annotated[str, Depends(_account)]
Sandboxes = Annotated[SandboxService, Depends(_service)]


def _json(model: Any, status: int = 200) -> JSONResponse:
    if isinstance(model, list):
        return JSONResponse([item.model_dump(mode="json", by_alias=True, exclude_none=True) for item in model],
                            status_code=status)
    return JSONResponse(model.model_dump(mode="json", by_alias=True, exclude_none=True), status_code=status)


def _with_next_token(answer: JSONResponse, following: str | None) -> JSONResponse:
    """E2B's pagination: the next page's token in a header, none on the last page."""
    if following:
        answer.headers["x-next-token"] = following
    return answer


@router.post("/sandboxes")
@router.post("/v2/sandboxes")
async def create_sandbox(body: wire.NewSandbox, account: Account, sandboxes: Sandboxes) -> Response:
    return _json(await sandboxes.create(account, body), 201)


@router.get("/sandboxes")
async def list_running_sandboxes(
    account: Account, sandboxes: Sandboxes, metadata: str | None = None
) -> Response:
    query = SandboxQuery(metadata=parse_metadata_filter(metadata), states=frozenset({"running"}))
    page, _ = sandboxes.list(account, query, limit=10_000, after=None)
    return _json(page)


@router.get("/v2/sandboxes")
async def list_sandboxes(
    account: Account,
    sandboxes: Sandboxes,
    metadata: str | None = None,
    state: str | None = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
    order: Literal["asc", "desc"] = "desc",
    started_after: Annotated[datetime | None, Query(alias="startedAfter")] = None,
    template: Annotated[str | None, Query(min_length=1)] = None,
) -> Response:
    states = frozenset({"running", "paused"})
    if state:
        states = frozenset(item.strip() for item in state.split(",") if item.strip())
        if not states <= {"running", "paused"}:
            raise InvalidInput(f"state: expected running and/or paused, got {state!r}", field="state")
    query = SandboxQuery(metadata=parse_metadata_filter(metadata), states=states, started_after=started_after,
                         template=template)
    page, following = sandboxes.list(account, query, order=order, limit=limit, after=next_token)
    return _with_next_token(_json(page), following)


@router.get("/sandboxes/{sandbox_id}")
async def get_sandbox(sandbox_id: str, account: Account, sandboxes: Sandboxes) -> Response:
    return _json(sandboxes.info(account, sandbox_id))


@router.delete("/sandboxes/{sandbox_id}", status_code=204)
async def kill_sandbox(sandbox_id: str, account: Account, sandboxes: Sandboxes) -> None:
    await sandboxes.kill(account, sandbox_id)


@router.post("/sandboxes/{sandbox_id}/timeout", status_code=204)
async def set_timeout(sandbox_id: str, body: wire.Timeout, account: Account, sandboxes: Sandboxes) -> None:
    await sandboxes.set_timeout(account, sandbox_id, body.timeout)


@router.post("/sandboxes/{sandbox_id}/refreshes", status_code=204)
async def keep_alive(
    sandbox_id: str, account: Account, sandboxes: Sandboxes, body: wire.Refresh | None = None
) -> None:
    """Older SDKs' keep-alive: extends the sandbox's time (by ``duration``, else its default) like connect."""
    duration = body.duration if body and body.duration is not None else wire.DEFAULT_TIMEOUT_S
    await sandboxes.connect(account, sandbox_id, duration)


@router.post("/sandboxes/{sandbox_id}/pause", status_code=204)
async def pause_sandbox(
    sandbox_id: str, account: Account, sandboxes: Sandboxes, body: wire.PauseSandbox | None = None
) -> None:
    """SDKs before 2.30 send no body."""
    await sandboxes.pause(account, sandbox_id, body or wire.PauseSandbox())


@router.post("/sandboxes/{sandbox_id}/resume")
async def resume_sandbox(
    sandbox_id: str, body: wire.ResumeSandbox, account: Account, sandboxes: Sandboxes
) -> Response:
    return _json(await sandboxes.resume(account, sandbox_id, body), 201)


@router.post("/sandboxes/{sandbox_id}/connect")
@router.post("/v2/sandboxes/{sandbox_id}/connect")
async def connect_sandbox(
    sandbox_id: str, body: wire.ConnectSandbox, account: Account, sandboxes: Sandboxes
) -> Response:
    answer, resumed = await sandboxes.connect(account, sandbox_id, body.timeout, memory=body.memory)
    return _json(answer, 201 if resumed else 200)


@router.post("/sandboxes/{sandbox_id}/fork")
async def fork_sandbox(sandbox_id: str, body: wire.ForkSandbox, account: Account, sandboxes: Sandboxes) -> Response:
    return _json(await sandboxes.fork(account, sandbox_id, body), 201)


@router.post("/sandboxes/{sandbox_id}/snapshots")
async def snapshot_sandbox(
    sandbox_id: str, body: wire.SnapshotSandbox, account: Account, sandboxes: Sandboxes
) -> Response:
    return _json(await sandboxes.snapshot(account, sandbox_id, body.name), 201)


@router.get("/snapshots")
async def list_snapshots(
    account: Account,
    sandboxes: Sandboxes,
    sandbox_id: Annotated[str | None, Query(alias="sandboxID")] = None,
    name: Annotated[str | None, Query(min_length=1)] = None,
    limit: Annotated[int, Query(ge=1, le=1000)] = 100,
    next_token: Annotated[str | None, Query(alias="nextToken")] = None,
) -> Response:
    page, following = sandboxes.list_snapshots(account, sandbox_id=sandbox_id, name=name, limit=limit,
                                               after=next_token)
    return _with_next_token(_json(page), following)


@router.delete("/templates/{template_id}", status_code=204)
async def delete_snapshot(template_id: str, account: Account, sandboxes: Sandboxes) -> None:
    """How the SDK deletes a snapshot; boxd's own image cannot be deleted this way."""
    await sandboxes.delete_snapshot(account, template_id)


@router.get("/sandboxes/{sandbox_id}/metrics")
async def sandbox_metrics(
    sandbox_id: str,
    request: Request,
    account: Account,
    sandboxes: Sandboxes,
    start: Annotated[int | None, Query(ge=0)] = None,
    end: Annotated[int | None, Query(ge=0)] = None,
) -> Response:
    """The sandbox's samples from ``start`` through ``end`` (Unix seconds), oldest first."""
    sandboxes.info(account, sandbox_id)  # another account's, or a killed one, is not found
    samples = request.app.state.metrics.series(sandbox_id, start=start, end=end)
    return _json([
        wire.SandboxMetric(
            timestamp=datetime.fromtimestamp(int(sample.timestamp), tz=UTC), timestamp_unix=int(sample.timestamp),
            cpu_count=sample.cpu_count, cpu_used_pct=sample.cpu_used_pct, mem_used=sample.mem_used,
            mem_total=sample.mem_total, mem_cache=sample.mem_cache, disk_used=sample.disk_used,
            disk_total=sample.disk_total,
        )
        for sample in samples
    ])


@router.put("/sandboxes/{sandbox_id}/network")
@router.get("/sandboxes/{sandbox_id}/logs")
@router.get("/v2/sandboxes/{sandbox_id}/logs")
async def not_served(sandbox_id: str, request: Request, account: Account) -> None:
    raise Unsupported(f"{request.method} {request.url.path.rsplit('/', 1)[-1]}: not supported by boxd's E2B API")
