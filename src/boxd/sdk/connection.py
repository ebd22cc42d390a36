"""Where the SDK sends requests, and the local daemon it starts when none answers.

A setting comes from the call's argument, else the environment (``BOXD_URL``,
``BOXD_API_KEY``). Without a URL:

- inside a boxd machine, known by the key file the daemon writes there each time the
  machine becomes ready (``/etc/boxd/api-key``; ``BOXD_MACHINE_KEY_FILE`` names another
  one, for tests), the SDK talks to ``http://127.0.0.1:7345``, where the guest agent
  carries connections to the daemon, and uses that file's key when no key is given.
  It reads the file for every request: a fork gets its own key, and a client kept
  across the fork uses it. No daemon is started in a machine.
- elsewhere the SDK talks to the daemon of ``BOXD_HOME`` over its unix socket, starts
  that daemon in the background if it does not answer, and uses its local key when no
  key is given.
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

from boxd.config import MACHINE_API_PORT, MACHINE_KEY_PATH, boxd_home
from boxd.daemon import local_key_path, log_path, socket_path
from boxd.errors import InvalidInput
from boxd.errors import DaemonUnavailable

UNIX_SCHEME = "unix://"
# The host part is ignored over a unix socket; a fixed one keeps URLs well formed.
_UNIX_BASE_URL = "http://boxd"
MACHINE_BASE_URL = f"http://127.0.0.1:{MACHINE_API_PORT}"


@dataclass(frozen=True)
class Endpoint:
    base_url: str
    uds: Path | None = None
    # Set when this is the daemon of a BOXD_HOME: the SDK may start it and use its local key.
    home: Path | None = None
    # Set inside a machine: the key to use when none is given, read for each request.
    key_file: Path | None = None


def machine_key_path() -> Path:
    return Path(os.environ.get("BOXD_MACHINE_KEY_FILE") or MACHINE_KEY_PATH)


def resolve_endpoint(base_url: str | None) -> Endpoint:
    url = base_url or os.environ.get("BOXD_URL")
    home = boxd_home()
    if not url:
        key_file = machine_key_path()
        if key_file.is_file():
            return Endpoint(MACHINE_BASE_URL, key_file=key_file)
        return Endpoint(_UNIX_BASE_URL, uds=socket_path(home), home=home)
    if url.startswith(UNIX_SCHEME):
        path = Path(url[len(UNIX_SCHEME) :]).expanduser().resolve()
        return Endpoint(_UNIX_BASE_URL, uds=path, home=home if path == socket_path(home) else None)
    if url.startswith(("http://", "https://")):
        return Endpoint(url.rstrip("/"))
    raise InvalidInput(f"base_url: expected http://, https:// or unix://PATH, got {url!r}", field="base_url")


def _read_key(path: Path) -> str | None:
    try:
        return path.read_text().strip() or None
    except FileNotFoundError:
        return None


def local_key(home: Path) -> str | None:
    return _read_key(local_key_path(home))


class KeyFileAuth(httpx.Auth):
    """A bearer key read from a file for each request: the daemon may replace it (in a fork)."""

    def __init__(self, path: Path) -> None:
        self.path = path

    def auth_flow(self, request: httpx.Request):
        key = _read_key(self.path)
        if key:
            request.headers["authorization"] = f"Bearer {key}"
        yield request


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
