"""Files written so that a crash never publishes half of one, and checked by their hash."""

from __future__ import annotations

import hashlib
import os
from pathlib import Path


def fsync_path(path: Path) -> None:
    """Flush a file or directory, so a rename after it never publishes half-written data."""
    descriptor = os.open(path, os.O_RDONLY)
    try:
        os.fsync(descriptor)
    finally:
        os.close(descriptor)


def sha256_file(path: Path) -> str:
    with open(path, "rb") as handle:
        return hashlib.file_digest(handle, "sha256").hexdigest()
