"""Snapshots: named, versioned baselines saved from a machine, outliving it."""

from __future__ import annotations

from fastapi import APIRouter

from boxd.daemon.routes.deps import AccountName, Snapshots
from boxd.models import Snapshot, SnapshotCreate

router = APIRouter(prefix="/v1/snapshots", tags=["snapshots"])


@router.post("", status_code=201)
async def save_snapshot(body: SnapshotCreate, account: AccountName, snapshots: Snapshots) -> Snapshot:
    """Save a new version of ``name`` from a running machine.

    Answers once the instant is taken (the machine's only pause), with the version
    ``saving``; poll it until it is ``ready`` (or ``failed``).
    """
    return await snapshots.save(account, body)


@router.get("")
async def list_snapshots(account: AccountName, snapshots: Snapshots) -> list[Snapshot]:
    """Every version of every snapshot of the account."""
    return snapshots.list(account)


@router.get("/{ref}")
async def get_snapshot(ref: str, account: AccountName, snapshots: Snapshots) -> Snapshot:
    """NAME (its newest ready version), NAME@VERSION or a digest."""
    return snapshots.get(account, ref)


@router.delete("/{ref}")
async def delete_snapshot(ref: str, account: AccountName, snapshots: Snapshots) -> list[Snapshot]:
    """NAME@VERSION or a digest deletes that version; NAME deletes all of its versions."""
    return await snapshots.delete(account, ref)
