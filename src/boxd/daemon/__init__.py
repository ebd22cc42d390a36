"""The boxd daemon: HTTP API, state store and machine policies.

Only where a local daemon listens is defined here, since the SDK needs that too without
importing the server.
"""

from pathlib import Path

DEFAULT_PORT = 7345


def socket_path(home: Path) -> Path:
    """The local daemon's unix socket (mode 600): local SDK calls and admin calls."""
    return home / "boxd.sock"


def local_key_path(home: Path) -> Path:
    """The local account's API key, written by the daemon at its first start (mode 600)."""
    return home / "local.key"


def log_path(home: Path) -> Path:
    """Where a daemon the SDK started in the background writes its logs."""
    return home / "daemon.log"
