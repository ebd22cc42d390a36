"""Where boxd keeps its state on the host.

Everything lives under one data directory, ``BOXD_HOME`` (default
``$XDG_DATA_HOME/boxd``, i.e. ``~/.local/share/boxd``). Guest RAM files go to a
tmpfs (``/dev/shm``) because forks map them copy-on-write and they must never hit a
real disk on the hot path.
"""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def boxd_home() -> Path:
    explicit = os.environ.get("BOXD_HOME")
    if explicit:
        return Path(explicit).expanduser().resolve()
    xdg = os.environ.get("XDG_DATA_HOME") or str(Path.home() / ".local" / "share")
    return (Path(xdg) / "boxd").resolve()


# Commands run and files are written as this guest user unless asked otherwise.
DEFAULT_USER = "boxd"
# Inside a machine: the key the daemon hands it, which the SDK there uses by itself.
MACHINE_KEY_PATH = Path("/etc/boxd/api-key")
# Inside a machine: where the agent serves the boxd API, tunnelled to the daemon.
MACHINE_API_PORT = 7345


def images_dir(home: Path | None = None) -> Path:
    return (home or boxd_home()) / "images"


def vms_dir(home: Path | None = None) -> Path:
    return (home or boxd_home()) / "vms"


def shm_dir(home: Path | None = None) -> Path:
    """A tmpfs folder for guest RAM, one per data directory so two homes never collide."""
    base = Path(os.environ.get("BOXD_SHM", "/dev/shm"))
    tag = hashlib.sha256(str(home or boxd_home()).encode()).hexdigest()[:12]
    return base / f"boxd-{tag}"
