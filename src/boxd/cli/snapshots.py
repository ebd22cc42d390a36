"""``boxd snapshots ...``: named, versioned baselines that outlive their machine."""

from __future__ import annotations

import click
from rich.progress import BarColumn, Progress, TaskProgressColumn, TextColumn, TimeElapsedColumn

from boxd.cli import output
from boxd.cli.clients import daemon
from boxd.models import Snapshot, SnapshotState


@click.group()
def snapshots() -> None:
    """Snapshots: start new machines at a saved instant (boxd machine new --from-snapshot)."""


@snapshots.command("save")
@click.argument("machine")
@click.argument("name")
@click.option("--timeout", type=float, default=600, show_default=True, help="seconds to wait until saved")
def save(machine: str, name: str, timeout: float) -> None:
    """Save a new version of NAME from the running MACHINE, which pauses only briefly."""
    # On stderr, so that stdout stays the result alone.
    bar = Progress(
        TextColumn("saving {task.description}"), BarColumn(), TaskProgressColumn(), TimeElapsedColumn(),
        console=output.err, transient=True,
    )
    task = bar.add_task(name, total=1.0)

    def advance(snapshot: Snapshot) -> None:
        done = 1.0 if snapshot.state is SnapshotState.READY else snapshot.progress or 0.0
        bar.update(task, description=snapshot.ref, completed=done)

    with daemon() as boxd, bar:
        saved = boxd.snapshots.save(machine, name, timeout=timeout, progress=advance)
    output.fields(
        {
            "ref": saved.ref,
            "digest": (saved.digest or "")[:12],
            "size": output.size(saved.size_bytes),
            "pause": output.pause(saved.pause_ms),
        }
    )


@snapshots.command("list")
def list_snapshots() -> None:
    """Every version of every snapshot of your account."""
    with daemon() as boxd:
        output.snapshots(boxd.snapshots.list())


@snapshots.command("get")
@click.argument("ref")
def get(ref: str) -> None:
    """One snapshot: NAME (its newest ready version), NAME@VERSION or a digest."""
    with daemon() as boxd:
        output.snapshot(boxd.snapshots.get(ref))


@snapshots.command("delete")
@click.argument("ref")
def delete(ref: str) -> None:
    """Delete one version (NAME@VERSION or a digest), or every version of NAME."""
    with daemon() as boxd:
        gone = boxd.snapshots.delete(ref)
    output.err.print(f"deleted {', '.join(snapshot.ref for snapshot in gone)}")
