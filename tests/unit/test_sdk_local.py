"""The embedded default: with no BOXD_URL the SDK starts the local daemon itself."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import time

import pytest
from fakes import short_home

from boxd import Boxd
from boxd.config import shm_dir
from boxd.daemon import local_key_path, log_path, socket_path

home = pytest.fixture(short_home)


def _stop_daemon(home) -> None:
    """Stop the daemon the SDK started: a child of this process, so reap it too."""
    pid = int((home / "daemon.lock").read_text())
    os.kill(pid, signal.SIGTERM)
    deadline = time.monotonic() + 15
    while time.monotonic() < deadline:
        try:
            if os.waitpid(pid, os.WNOHANG) != (0, 0):
                return
        except ChildProcessError:  # reaped already
            return
        time.sleep(0.1)
    os.kill(pid, signal.SIGKILL)


def test_the_sdk_starts_a_daemon_when_none_answers(home, monkeypatch):
    monkeypatch.setenv("BOXD_HOME", str(home))
    monkeypatch.setenv("BOXD_PORT", "0")  # any free port: other daemons may run on this host
    monkeypatch.delenv("BOXD_URL", raising=False)
    monkeypatch.delenv("BOXD_API_KEY", raising=False)
    try:
        with Boxd() as boxd:
            assert boxd.health().status == "ok"
            assert boxd.machines.list() == []  # authenticated with the local key
        assert stat.S_IMODE(socket_path(home).stat().st_mode) == 0o600
        assert stat.S_IMODE(local_key_path(home).stat().st_mode) == 0o600
        assert "daemon.listening" in log_path(home).read_text()
        # A second client finds the running daemon instead of starting another one.
        pid = (home / "daemon.lock").read_text()
        with Boxd() as again:
            assert again.health().status == "ok"
        assert (home / "daemon.lock").read_text() == pid
    finally:
        if (home / "daemon.lock").exists():
            _stop_daemon(home)
        shutil.rmtree(shm_dir(home), ignore_errors=True)
