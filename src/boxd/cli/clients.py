"""The SDK clients CLI commands use: the configured daemon, or the local one for admin."""

from __future__ import annotations

from boxd.config import boxd_home
from boxd.daemon import socket_path
from boxd.sdk import Boxd
from boxd.sdk.connection import UNIX_SCHEME


def daemon() -> Boxd:
    """The daemon of ``BOXD_URL``/``BOXD_API_KEY``, else the local one (started if needed)."""
    return Boxd()


def local_admin() -> Boxd:
    """The local daemon's socket: the only place admin calls are served."""
    return Boxd(base_url=f"{UNIX_SCHEME}{socket_path(boxd_home())}")
