"""The real daemon (uvicorn on TCP and on its unix socket at once) with a FakeRuntime."""

from __future__ import annotations

import asyncio
import logging
import stat

import httpx
import pytest
from fakes import FakeRuntime, daemon_thread, short_home

from boxd.daemon import local_key_path, socket_path
from boxd.daemon.logs import KeyValueFormatter, event
from boxd.daemon.server import Daemon
from boxd.errors import HostError

home = pytest.fixture(short_home)


def over_socket(home) -> httpx.Client:
    return httpx.Client(transport=httpx.HTTPTransport(uds=str(socket_path(home))), base_url="http://boxd")


def test_serves_tcp_and_the_unix_socket_with_admin_only_on_the_socket(home):
    with daemon_thread(home) as daemon:
        mode = stat.S_IMODE(socket_path(home).stat().st_mode)
        assert mode == 0o600
        assert stat.S_IMODE(local_key_path(home).stat().st_mode) == 0o600
        key = local_key_path(home).read_text().strip()
        with httpx.Client(base_url=f"http://127.0.0.1:{daemon.port}") as tcp, over_socket(home) as local:
            assert tcp.get("/v1/health").status_code == 200
            assert tcp.get("/v1/admin/keys").status_code == 403
            assert local.get("/v1/admin/keys").status_code == 200
            auth = {"authorization": f"Bearer {key}"}
            assert tcp.get("/v1/machines", headers=auth).status_code == 200
            assert local.get("/v1/machines").status_code == 401
            assert tcp.get("/openapi.json").json()["info"]["title"] == "boxd"
    assert not socket_path(home).exists()


def test_one_daemon_per_home(home):
    with daemon_thread(home):
        with pytest.raises(HostError, match="another boxd daemon"):
            asyncio.run(Daemon(home, port=0, runtime=FakeRuntime()).serve())


def test_a_restarted_daemon_readopts_its_machines(home):
    runtime = FakeRuntime()
    with daemon_thread(home, runtime):
        key = local_key_path(home).read_text().strip()
        with over_socket(home) as local:
            local.headers["authorization"] = f"Bearer {key}"
            created = local.post("/v1/machines", json={"name": "survivor"}).json()
            assert local.post("/v1/machines/survivor/wait").json()["state"] == "running"
    assert runtime.closed  # the daemon let go of the runtime, not of the machine
    assert created["id"] in runtime.host.vms

    again = FakeRuntime(runtime.host)
    with daemon_thread(home, again), over_socket(home) as local:
        assert local_key_path(home).read_text().strip() == key  # the local key is kept
        local.headers["authorization"] = f"Bearer {key}"
        assert again.adopted == {created["id"]}
        result = local.post("/v1/machines/survivor/exec", json={"argv": ["echo", "back"]}).json()
        assert result["exit_code"] == 0


def test_exec_stream_arrives_while_the_command_runs(home):
    with daemon_thread(home), over_socket(home) as local:
        local.headers["authorization"] = "Bearer " + local_key_path(home).read_text().strip()
        local.post("/v1/machines", json={"name": "live"})
        body = {"cmd": "echo first; sleep 1; echo second"}
        with local.stream("POST", "/v1/machines/live/exec/stream", json=body, timeout=30) as response:
            lines = response.iter_lines()
            assert '"started"' in next(lines)
            assert '"stdout"' in next(lines)  # before the sleep is over
            rest = list(lines)
        assert '"exit"' in rest[-1]


def test_log_lines_are_key_value_with_the_machine_id(caplog):
    formatter = KeyValueFormatter()
    with caplog.at_level(logging.INFO, logger="boxd.test"):
        event(logging.getLogger("boxd.test"), "machine.ready", machine="m-0123456789ab", name="rl base")
    line = formatter.format(caplog.records[-1])
    assert "level=info event=machine.ready machine=m-0123456789ab" in line
    assert 'name="rl base"' in line
