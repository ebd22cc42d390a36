"""What the daemon may ask of a VM runtime, and nothing about HTTP.

The daemon talks to a ``Runtime``; ``LocalRuntime`` runs QEMU on this host, and a remote
runtime (a host agent on another node) can offer the same calls. Everything crosses this
boundary as plain data, so that it can cross a process boundary too.
"""

from __future__ import annotations

import enum
from collections.abc import AsyncIterator, Callable
from dataclasses import asdict, dataclass, field
from typing import Any, Protocol

from boxd.config import DEFAULT_USER  # noqa: F401 (the runtime's callers take it from here)
from boxd.runtime.agent_client import ExecEvent
from boxd.runtime.snapshots import SnapshotManifest


class VMState(str, enum.Enum):
    RUNNING = "running"
    PAUSED = "paused"  # suspended: vCPUs stopped, memory kept
    STOPPED = "stopped"  # hibernated: no process, its state on disk, nothing lost
    FAILED = "failed"  # the process is gone without us stopping it


@dataclass(frozen=True)
class VMSpec:
    """What a machine is made of. The image is the digest of a built guest image."""

    image: str
    vcpus: int = 1
    memory_mib: int = 512
    disk_gib: int = 4
    isolated: bool = False
    http_port: int = 8080  # the guest port the machine's URL leads to

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> "VMSpec":
        return cls(**{k: data[k] for k in cls.__dataclass_fields__ if k in data})


@dataclass(frozen=True)
class ExecRequest:
    argv: list[str] | None = None
    shell: str | None = None
    env: dict[str, str] = field(default_factory=dict)
    cwd: str | None = None
    user: str = DEFAULT_USER
    stdin: bytes | None = None
    keep_stdin: bool = False  # stdin stays open for later input (``process(op="stdin")``)
    timeout: float | None = None
    tag: str | None = None
    pty: dict[str, int] | None = None  # rows and cols: run in a terminal


@dataclass(frozen=True)
class VMInfo:
    id: str
    state: VMState
    pid: int | None
    accelerator: str
    console_log: str
    # The host port on 127.0.0.1 that leads to the guest's http_port (None while hibernated).
    url_port: int | None = None
    host: str | None = None  # the host that runs it, when the runtime spans several


@dataclass(frozen=True)
class CheckpointTaken:
    id: str  # the runtime's name for the capture; the daemon maps user names to it
    pause_s: float  # how long the machine's vCPUs stood still


class Runtime(Protocol):
    async def create(
        self, vm_id: str, spec: VMSpec, *, snapshot: str | None = None, host: str | None = None
    ) -> VMInfo:
        """Start a new machine from its image, or at a snapshot's instant (its digest);
        returns once QEMU runs (not yet ready). ``host``: where, when the runtime spans
        several (default: its choice)."""

    async def adopt(self, vm_id: str) -> VMInfo:
        """Take over a machine a previous daemon started (after a restart)."""

    async def info(self, vm_id: str) -> VMInfo: ...

    async def wait_ready(self, vm_id: str, timeout: float) -> None:
        """Return once the machine's agent answers; ``Timeout`` otherwise."""

    def exec(self, vm_id: str, request: ExecRequest) -> AsyncIterator[ExecEvent]: ...

    def attach(self, vm_id: str, pid: int) -> AsyncIterator[ExecEvent]:
        """Follow a running process from now on (``started``, output, ``exit``)."""

    async def process(self, vm_id: str, op: str, **fields: Any) -> dict[str, Any]:
        """processes, stdin, close_stdin, signal, resize: the agent's process operations,
        which name a process by ``pid``."""

    async def write_file(
        self, vm_id: str, path: str, chunks: AsyncIterator[bytes], *, mode: int | None = None, user: str = DEFAULT_USER
    ) -> int: ...

    def read_file(self, vm_id: str, path: str) -> AsyncIterator[bytes]: ...

    async def fs(self, vm_id: str, op: str, **fields: Any) -> dict[str, Any]:
        """stat, list_dir, make_dir, remove, move: the agent's small file operations."""

    def watch(self, vm_id: str, path: str, *, recursive: bool = False) -> AsyncIterator[tuple[str, str]]:
        """``agent_client.WATCH_STARTED`` once the guest watches a directory (one it cannot
        watch raises instead), then its changes as (name relative to it,
        create|write|remove|rename|chmod)."""

    async def fork(self, source_id: str, new_ids: list[str], *, host: str | None = None) -> list[VMInfo]:
        """New machines continuing from one instant of a running one; they run, not yet ready.
        ``host``: where they go, when the runtime spans several (default: its choice)."""

    async def delete(self, vm_id: str) -> None:
        """Stop the machine if it runs and remove every process, socket and file of it."""

    async def checkpoint(self, vm_id: str) -> CheckpointTaken:
        """Keep this instant of a running machine; it goes when dropped or when the machine does."""

    async def restore(self, vm_id: str, checkpoint_id: str) -> VMInfo:
        """Rewind the machine in place to one of its checkpoints; it runs, not yet ready."""

    async def drop_checkpoint(self, vm_id: str, checkpoint_id: str) -> None: ...

    async def save_snapshot(
        self, vm_id: str, checkpoint_id: str, progress: Callable[[int, int], None] | None = None
    ) -> SnapshotManifest:
        """Write a checkpoint out as a durable snapshot; ``progress(done, total)`` in bytes."""

    async def delete_snapshot(self, digest: str) -> None: ...

    async def suspend(self, vm_id: str) -> None:
        """Stop the vCPUs; memory and processes stay as they are."""

    async def hibernate(self, vm_id: str, *, keep_memory: bool = True) -> None:
        """Write the machine's whole state to disk and end its process, freeing its memory.
        Without ``keep_memory`` only its disk is kept (synced first): waking boots it from it."""

    async def resume(self, vm_id: str) -> None:
        """Run a suspended machine again, or bring a hibernated one back; returns once its
        vCPUs run (a hibernated one is then not yet ready)."""

    async def hosts(self) -> list[str]:
        """The live hosts machines may go to, by name, when the runtime spans several."""

    async def lost(self) -> list[str]:
        """Machines whose host is gone (a dead node): nothing of them can come back."""

    async def collect_garbage(self) -> None:
        """Remove what no machine uses any more (disk layers, captures, stray templates)."""
