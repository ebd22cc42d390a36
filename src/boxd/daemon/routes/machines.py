"""Machines: create, inspect, delete, run commands in them, move files in and out."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any, TypeVar

from fastapi import APIRouter, Query, Request
from fastapi.responses import StreamingResponse

from boxd.daemon.routes.deps import AccountName, Machines
from boxd.errors import BoxdError, InvalidInput
from boxd.errors import TooLarge
from boxd.models import (
    Checkpoint,
    CheckpointCreate,
    ExecBody,
    ExecEvent,
    ExecResult,
    FileWritten,
    Machine,
    MachineCreate,
    MachineFork,
)
from boxd.runtime.interface import DEFAULT_USER

router = APIRouter(prefix="/v1/machines", tags=["machines"])

T = TypeVar("T")
MAX_PATH = 4096

GuestPath = Annotated[str, Query(description="an absolute path inside the machine")]


def _checked_path(path: str) -> str:
    if not path.startswith("/"):
        raise InvalidInput(f"path: must be an absolute path inside the machine, got {path!r}", field="path")
    if "\0" in path or len(path) > MAX_PATH:
        raise InvalidInput(f"path: must be under {MAX_PATH} characters and hold no NUL byte", field="path")
    return path


async def _primed(stream: AsyncIterator[T]) -> AsyncIterator[T]:
    """``stream``, run up to its first item before the response starts.

    An error that comes before any output (no such machine, no such file) is then still
    an HTTP error with its status instead of a broken 200.
    """
    head: list[T] = []
    with contextlib.suppress(StopAsyncIteration):
        head.append(await anext(stream))

    async def replay() -> AsyncIterator[T]:
        for item in head:
            yield item
        if head:
            async for item in stream:
                yield item

    return replay()


@router.post("", status_code=201)
async def create_machine(body: MachineCreate, account: AccountName, machines: Machines) -> Machine:
    """Start a machine; it is ``starting`` until its agent answers (see ``/wait``)."""
    return await machines.create(account, body)


@router.post("/{ref}/fork", status_code=201)
async def fork_machine(ref: str, body: MachineFork, account: AccountName, machines: Machines) -> Machine:
    """A new machine that continues from this instant of ``ref``; ``starting`` until its agent answers."""
    return await machines.fork(account, ref, body)


@router.post("/{ref}/checkpoints", status_code=201)
async def save_checkpoint(ref: str, body: CheckpointCreate, account: AccountName, machines: Machines) -> Checkpoint:
    """Keep this instant of the machine under ``name``; the machine pauses only briefly."""
    return await machines.save_checkpoint(account, ref, body.name)


@router.get("/{ref}/checkpoints")
async def list_checkpoints(ref: str, account: AccountName, machines: Machines) -> list[Checkpoint]:
    return await machines.list_checkpoints(account, ref)


@router.post("/{ref}/checkpoints/{name}/restore")
async def restore_checkpoint(ref: str, name: str, account: AccountName, machines: Machines) -> Machine:
    """Rewind the machine in place to the checkpoint; it keeps its name and id. Returns once it runs."""
    return await machines.restore_checkpoint(account, ref, name)


@router.delete("/{ref}/checkpoints/{name}", status_code=204)
async def delete_checkpoint(ref: str, name: str, account: AccountName, machines: Machines) -> None:
    await machines.delete_checkpoint(account, ref, name)


@router.post("/{ref}/suspend")
async def suspend_machine(ref: str, account: AccountName, machines: Machines) -> Machine:
    """Stop the machine's vCPUs, keeping its memory; any use of it wakes it."""
    return await machines.suspend(account, ref)


@router.post("/{ref}/hibernate")
async def hibernate_machine(ref: str, account: AccountName, machines: Machines) -> Machine:
    """Save the machine's state to disk and end its process; any use of it wakes it."""
    return await machines.hibernate(account, ref)


@router.post("/{ref}/resume")
async def resume_machine(ref: str, account: AccountName, machines: Machines) -> Machine:
    """Wake a suspended or hibernated machine (a hibernated one counts against the quota again)."""
    return await machines.resume(account, ref)


@router.get("")
async def list_machines(account: AccountName, machines: Machines) -> list[Machine]:
    return await machines.list(account)


@router.get("/{ref}")
async def get_machine(ref: str, account: AccountName, machines: Machines) -> Machine:
    return await machines.get(account, ref)


@router.delete("/{ref}")
async def delete_machine(ref: str, account: AccountName, machines: Machines) -> Machine:
    return await machines.delete(account, ref)


@router.post("/{ref}/wait")
async def wait_machine(
    ref: str,
    account: AccountName,
    machines: Machines,
    timeout: Annotated[float, Query(gt=0, le=3600)] = 60,
) -> Machine:
    """Return once the machine runs (waking it, as any use does): 504 if it still starts
    after ``timeout`` s, 409 if it failed."""
    return await machines.usable(account, ref, timeout)


@router.post("/{ref}/exec")
async def exec_command(ref: str, body: ExecBody, account: AccountName, machines: Machines) -> ExecResult:
    return await machines.exec(account, ref, body)


async def _ndjson(events: AsyncIterator[ExecEvent]) -> AsyncIterator[str]:
    try:
        async for item in events:
            yield item.model_dump_json(exclude_defaults=True) + "\n"
    except BoxdError as error:  # the status line is sent already: say it in the stream
        yield ExecEvent(type="error", error=error.to_dict()).model_dump_json(exclude_defaults=True) + "\n"


@router.post(
    "/{ref}/exec/stream",
    response_class=StreamingResponse,
    responses={200: {"content": {"application/x-ndjson": {}}, "description": "one ExecEvent per line"}},
)
async def exec_command_stream(ref: str, body: ExecBody, account: AccountName, machines: Machines) -> Any:
    events = await _primed(machines.exec_stream(account, ref, body))
    return StreamingResponse(_ndjson(events), media_type="application/x-ndjson")


_OCTETS: dict[str, Any] = {"content": {"application/octet-stream": {"schema": {"type": "string", "format": "binary"}}}}


@router.put("/{ref}/files", openapi_extra={"requestBody": {**_OCTETS, "required": True}})
async def upload_file(
    ref: str,
    path: GuestPath,
    request: Request,
    account: AccountName,
    machines: Machines,
    mode: Annotated[int | None, Query(ge=0, le=0o7777, description="permission bits, e.g. 420 for 0644")] = None,
    user: Annotated[str, Query(min_length=1, description="who owns the file")] = DEFAULT_USER,
) -> FileWritten:
    """Write the request's body to ``path``, streamed; the file appears whole or not at all."""
    limit = machines.limits.max_upload_bytes
    declared = request.headers.get("content-length")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise TooLarge(f"body: {declared} bytes is over the upload limit of {limit} bytes", field="body", limit=limit)

    async def body() -> AsyncIterator[bytes]:
        received = 0
        async for chunk in request.stream():
            received += len(chunk)
            if received > limit:
                raise TooLarge(f"body: over the upload limit of {limit} bytes", field="body", limit=limit)
            yield chunk

    size = await machines.write_file(account, ref, _checked_path(path), body(), mode=mode, user=user)
    return FileWritten(path=path, size=size)


@router.get("/{ref}/files", response_class=StreamingResponse, responses={200: _OCTETS})
async def download_file(ref: str, path: GuestPath, account: AccountName, machines: Machines) -> Any:
    chunks = await _primed(machines.read_file(account, ref, _checked_path(path)))
    return StreamingResponse(chunks, media_type="application/octet-stream")
