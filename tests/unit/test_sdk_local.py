"""The defaults with no BOXD_URL: the SDK starts the local daemon itself, except inside
a machine, where it reaches the daemon that runs the machine, with the machine's key."""

from __future__ import annotations

import os
import shutil
import signal
import stat
import time

import httpx
import pytest
from fakes import short_home

from boxd import AsyncBoxd, Boxd
from boxd.config import shm_dir
from boxd.daemon import local_key_path, log_path, socket_path
from boxd.sdk import async_client
from boxd.sdk.connection import resolve_endpoint

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
    monkeypatch.setenv("BOXD_MACHINE_KEY_FILE", str(home / "no-machine-key"))  # even run in a machine
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


@pytest.fixture
def in_a_machine(tmp_path, monkeypatch):
    """The environment of code in a machine: a key file from the daemon, no BOXD_URL."""
    key_file = tmp_path / "api-key"
    key_file.write_text("bxd_machine_key\n")
    monkeypatch.setenv("BOXD_MACHINE_KEY_FILE", str(key_file))
    monkeypatch.setenv("BOXD_HOME", str(tmp_path / "home"))
    monkeypatch.delenv("BOXD_URL", raising=False)
    monkeypatch.delenv("BOXD_API_KEY", raising=False)
    return key_file


@pytest.mark.anyio
async def test_in_a_machine_the_sdk_uses_the_tunnel_and_starts_no_daemon(in_a_machine, tmp_path, monkeypatch):
    started = []

    async def no_daemon(home, timeout=60.0):
        started.append(home)

    monkeypatch.setattr(async_client, "ensure_local_daemon", no_daemon)
    endpoint = resolve_endpoint(None)
    assert (endpoint.base_url, endpoint.uds, endpoint.home) == ("http://127.0.0.1:7345", None, None)
    async with AsyncBoxd() as boxd:
        http = await boxd._client()  # what a first call opens, without calling anyone
        assert str(http.base_url) == "http://127.0.0.1:7345"
    assert started == [] and not (tmp_path / "home").exists()


@pytest.mark.anyio
async def test_in_a_machine_each_request_carries_the_key_in_the_file_then(in_a_machine):
    keys = []

    def answer(request: httpx.Request) -> httpx.Response:
        keys.append((request.url.host, request.url.port, request.headers.get("authorization")))
        return httpx.Response(200, json={"status": "ok", "version": "test"})

    async with AsyncBoxd(transport=httpx.MockTransport(answer)) as boxd:
        await boxd.health()
        in_a_machine.write_text("bxd_key_of_a_fork\n")  # the daemon rewrote it, in a fork
        await boxd.health()
    async with AsyncBoxd(api_key="bxd_given", transport=httpx.MockTransport(answer)) as boxd:
        await boxd.health()
    assert keys == [
        ("127.0.0.1", 7345, "Bearer bxd_machine_key"),
        ("127.0.0.1", 7345, "Bearer bxd_key_of_a_fork"),
        ("127.0.0.1", 7345, "Bearer bxd_given"),  # a key given wins
    ]


def test_a_url_given_wins_over_the_machine(in_a_machine, monkeypatch):
    monkeypatch.setenv("BOXD_URL", "http://daemon.example:9000")
    endpoint = resolve_endpoint(None)
    assert (endpoint.base_url, endpoint.key_file) == ("http://daemon.example:9000", None)
