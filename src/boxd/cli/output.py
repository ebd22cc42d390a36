"""How the CLI shows things: rich tables on stdout, one-line errors on stderr."""

from __future__ import annotations

import sys
from collections.abc import Iterable, Sequence
from datetime import datetime

from rich.console import Console
from rich.table import Table

from boxd.models import Account, ApiKey, Checkpoint, Machine, MachineState, Snapshot, SnapshotState

# A pipe or a file gets whole lines (ids and URLs are there to be copied); rich would
# cut a table to 80 columns there.
PIPED_WIDTH = 250
out = Console(highlight=False, width=None if sys.stdout.isatty() else PIPED_WIDTH)
err = Console(stderr=True, highlight=False)


def _when(moment: datetime | None) -> str:
    return "" if moment is None else moment.astimezone().strftime("%Y-%m-%d %H:%M:%S")


def size(count: int | None) -> str:
    """Bytes in binary units, as memory and disk are shown."""
    if count is None:
        return ""
    if count < 1024:
        return f"{count} B"
    amount = float(count)
    for unit in ("KiB", "MiB", "GiB"):
        amount /= 1024
        if amount < 1024:
            break
    return f"{amount:.1f} {unit}"


def pause(milliseconds: float | None) -> str:
    return "" if milliseconds is None else f"{milliseconds:g} ms"


def table(columns: Sequence[str], rows: Iterable[Sequence[object]]) -> None:
    grid = Table(*columns, box=None, pad_edge=False, header_style="bold")
    for row in rows:
        grid.add_row(*("" if value is None else str(value) for value in row))
    out.print(grid)


def fields(pairs: dict[str, object]) -> None:
    grid = Table.grid(padding=(0, 2))
    for key, value in pairs.items():
        grid.add_row(f"[bold]{key}[/bold]", "" if value is None else str(value))
    out.print(grid)


def _shared_fields(item: Machine | Snapshot) -> dict[str, object]:
    """What a machine and a snapshot of it show alike: size, isolation, when made, why failed."""
    return {
        "vcpus": item.vcpus,
        "memory": f"{item.memory_mib} MiB",
        "disk": f"{item.disk_gib} GiB",
        "isolated": "yes" if item.isolated else "no",
        "created": _when(item.created_at),
        **({"reason": item.reason} if item.reason else {}),
    }


# What a machine's state means to someone who did not ask for it.
_STATE_MEANING = {MachineState.PAUSED: "suspended", MachineState.STOPPED: "hibernated"}


def _machine_state(item: Machine) -> str:
    meaning = _STATE_MEANING.get(item.state)
    return item.state.value if meaning is None else f"{item.state.value} ({meaning})"


def _idle_step(seconds: float | None) -> str:
    if seconds is None:
        return "the daemon's default"
    return "never" if seconds == 0 else f"{seconds:g} s"


def machine(item: Machine) -> None:
    fields(
        {
            "id": item.id,
            "name": item.name,
            "state": _machine_state(item),
            **({"host": item.host} if item.host else {}),
            "url": item.url,
            "public": "yes" if item.public else "no",
            "http port": item.http_port,
            "suspend after idle": _idle_step(item.suspend_after_s),
            "hibernate after suspend": _idle_step(item.hibernate_after_s),
            **_shared_fields(item),
        }
    )


def machines(items: Iterable[Machine]) -> None:
    items = list(items)
    # The HOST column only where machines run on a cluster.
    on_hosts = any(m.host for m in items)
    table(
        ["NAME", "ID", "STATE", *(["HOST"] if on_hosts else []), "VCPUS", "MEMORY", "DISK", "CREATED", "URL"],
        [
            (
                m.name, m.id, _machine_state(m), *([m.host or "-"] if on_hosts else []), m.vcpus,
                f"{m.memory_mib} MiB", f"{m.disk_gib} GiB", _when(m.created_at), m.url,
            )
            for m in items
        ],
    )


def checkpoints(items: Iterable[Checkpoint]) -> None:
    table(["NAME", "PAUSE", "CREATED"], [(c.name, pause(c.pause_ms), _when(c.created_at)) for c in items])


def _snapshot_state(item: Snapshot) -> str:
    if item.state is SnapshotState.SAVING and item.progress is not None:
        return f"saving {item.progress:.0%}"
    return item.state.value


def snapshot(item: Snapshot) -> None:
    fields(
        {
            "ref": item.ref,
            "state": _snapshot_state(item),
            "digest": item.digest,
            "size": size(item.size_bytes),
            "pause": pause(item.pause_ms),
            "machine": item.machine,
            **_shared_fields(item),
        }
    )


def snapshots(items: Iterable[Snapshot]) -> None:
    table(
        ["REF", "STATE", "SIZE", "DIGEST", "CREATED", "MACHINE"],
        [
            (s.ref, _snapshot_state(s), size(s.size_bytes), (s.digest or "")[:12], _when(s.created_at), s.machine)
            for s in items
        ],
    )


def keys(items: Iterable[ApiKey]) -> None:
    table(
        ["ID", "ACCOUNT", "NAME", "CREATED", "REVOKED"],
        [(k.id, k.account, k.name, _when(k.created_at), _when(k.revoked_at)) for k in items],
    )


def accounts(items: Iterable[Account]) -> None:
    table(["NAME", "MAX MACHINES", "CREATED"], [(a.name, a.max_machines, _when(a.created_at)) for a in items])
