"""Where the SDK sends requests, and the local daemon it starts when none answers.

A setting comes from the call's argument, else the environment (``BOXD_URL``,
``BOXD_API_KEY``). Without a URL the SDK talks to the daemon of ``BOXD_HOME`` over its
unix socket, starts that daemon in the background if it does not answer, and uses its
local key when no key is given.
"""

from __future__ import annotations

import asyncio
import fcntl
import os
import subprocess
import sys
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from boxd.config import boxd_home
from boxd.daemon import local_key_path, log_path, socket_path
from boxd.errors import InvalidInput
from boxd.errors import DaemonUnavailable

UNIX_SCHEME = "unix://"
# The host part is ignored over a unix socket; a fixed one keeps URLs well formed.
_UNIX_BASE_URL = "http://boxd"


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    uds: Path | None = None
    # Set when this is the daemon of a BOXD_HOME: the SDK may start it and use its local key.
    home: Path | None = None


def resolve_endpoint(base_url: str | None) -> Endpoint:
    url = base_url or os.environ.get("BOXD_URL")
    home = boxd_home()
    if not url:
        return Endpoint(_UNIX_BASE_URL, uds=socket_path(home), home=home)
    if url.startswith(UNIX_SCHEME):
        path = Path(url[len(UNIX_SCHEME) :]).expanduser().resolve()
        return Endpoint(_UNIX_BASE_URL, uds=path, home=home if path == socket_path(home) else None)
    if url.startswith(("http://", "https://")):
        return Endpoint(url.rstrip("/"))
    raise InvalidInput(f"base_url: expected http://, https:// or unix://PATH, got {url!r}", field="base_url")


def local_key(home: Path) -> str | None:
    try:
        return local_key_path(home).read_text().strip() or None
    except FileNotFoundError:
        return None


async def _answers(probe: httpx.AsyncClient) -> bool:
    try:
        return (await probe.get("/v1/health")).status_code == 200
    except httpx.TransportError:
        return False


def _log_tail(path: Path, lines: int = 8) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except FileNotFoundError:
        return "(no log)"


async def ensure_local_daemon(home: Path, timeout: float = 60.0) -> None:
    """Start the daemon of ``home`` in the background unless one answers already."""
    transport = httpx.AsyncHTTPTransport(uds=str(socket_path(home)), verify=False)  # no TLS on a socket
    async with httpx.AsyncClient(transport=transport, base_url=_UNIX_BASE_URL, timeout=5) as probe:
        if await _answers(probe):
            return
        home.mkdir(parents=True, exist_ok=True, mode=0o700)
        # Serializes starters across processes: the second finds the first one's daemon.
        with open(home / "autostart.lock", "w") as lock:
            await asyncio.to_thread(fcntl.flock, lock, fcntl.LOCK_EX)
            if await _answers(probe):
                return
            await _start_daemon(home, probe, timeout)


async def _start_daemon(home: Path, probe: httpx.AsyncClient, timeout: float) -> None:
    log = log_path(home)
    with open(log, "ab") as output:
        daemon = subprocess.Popen(
            [sys.executable, "-m", "boxd", "serve"],
            env={**os.environ, "BOXD_HOME": str(home)},
            cwd=home,
            stdin=subprocess.DEVNULL,
            stdout=output,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # it outlives this process and its terminal
        )
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if await _answers(probe):
            # The daemon stays our child while we run: reap it whenever it exits, so
            # that a long training process never collects a zombie.
            threading.Thread(target=daemon.wait, name="boxd-daemon-reaper", daemon=True).start()
            return
        if daemon.poll() is not None:
            raise DaemonUnavailable(
                f"the local daemon exited at start (code {daemon.returncode}); {log} ends with:\n{_log_tail(log)}"
            )
        await asyncio.sleep(0.1)
    raise DaemonUnavailable(f"the local daemon did not answer within {timeout:g} s; see {log}")
