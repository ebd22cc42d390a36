"""boxd: self-hosted microVMs that can be forked while running.

    from boxd import Boxd
    boxd = Boxd()
    machine = boxd.machines.new("rl-base")
"""

import logging
from importlib.metadata import PackageNotFoundError, version

try:
    __version__ = version("boxd")
except PackageNotFoundError:  # running from a source tree that is not installed
    __version__ = "0+unknown"

# A library stays silent unless the application configures logging.
logging.getLogger(__name__).addHandler(logging.NullHandler())

from boxd.errors import (  # noqa: E402
    AgentUnavailable,
    AuthError,
    BoxdError,
    CommandFailed,
    Conflict,
    DaemonUnavailable,
    Forbidden,
    HostError,
    ImageError,
    InvalidInput,
    NotFound,
    QuotaExceeded,
    SnapshotUnusable,
    Timeout,
    TooLarge,
    Unsupported,
    VMError,
    VMLaunchFailure,
)
from boxd.models import (  # noqa: E402
    Checkpoint,
    ExecEvent,
    ExecResult,
    Machine,
    MachineState,
    Snapshot,
    SnapshotState,
)
from boxd.sdk import AsyncBoxd, Boxd  # noqa: E402

__all__ = [
    "AgentUnavailable",
    "AsyncBoxd",
    "AuthError",
    "Boxd",
    "BoxdError",
    "Checkpoint",
    "CommandFailed",
    "Conflict",
    "DaemonUnavailable",
    "ExecEvent",
    "ExecResult",
    "Forbidden",
    "HostError",
    "ImageError",
    "InvalidInput",
    "Machine",
    "MachineState",
    "NotFound",
    "QuotaExceeded",
    "Snapshot",
    "SnapshotState",
    "SnapshotUnusable",
    "Timeout",
    "TooLarge",
    "Unsupported",
    "VMError",
    "VMLaunchFailure",
    "__version__",
]
