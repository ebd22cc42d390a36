"""Idle machines (suspended, then hibernated, woken by any use) and machine URLs.

Idle time is the idle module's clock, which these tests move by hand; the machine URL
tests proxy for real, to a small HTTP server on 127.0.0.1 standing in for the app in
the machine.
"""

from __future__ import annotations

import asyncio
import base64
import threading
from dataclasses import dataclass
from datetime import UTC, datetime
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from fakes import ControlPlane, FakeRuntime
from test_daemon_api import error_of, new_machine

from boxd.daemon import idle
from boxd.daemon.idle import IdlePolicy
from boxd.models import ExecBody, Machine, MachineState
from boxd.runtime.interface import VMState
from boxd.runtime.qemu import free_port

pytestmark = pytest.mark.anyio

URL_FORMAT = "http://{name}.localhost:7345/"


class Clock:
    """Stands in for the idle module's clock: idle time passes only when a test says so."""

    def __init__(self) -> None:
        self.now = 1000.0

    def monotonic(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


@pytest.fixture
def clock(monkeypatch):
    clock = Clock()
    monkeypatch.setattr(idle, "time", clock)
    return clock


async def ready_machine(client, name: str, **fields) -> dict:
    await new_machine(client, name, **fields)
    ready = await client.post(f"/v1/machines/{name}/wait")
    assert ready.status_code == 200, ready.text
    return ready.json()


async def state_of(client, name: str) -> str:
    (machine,) = [m for m in (await client.get("/v1/machines")).json() if m["name"] == name]
    return machine["state"]


# -- the policy --------------------------------------------------------------------------


def machine_in(state: MachineState, suspend_after_s: float | None = None, hibernate_after_s: float | None = None):
    now = datetime.now(UTC)
    return Machine(
        id="m-000000000001", name="m", state=state, vcpus=1, memory_mib=512, disk_gib=4, isolated=False,
        suspend_after_s=suspend_after_s, hibernate_after_s=hibernate_after_s, created_at=now, updated_at=now,
    )


RUNNING, PAUSED, STOPPED, STARTING = (
    MachineState.RUNNING, MachineState.PAUSED, MachineState.STOPPED, MachineState.STARTING
)


@pytest.mark.parametrize(
    "policy, machine, idle_s, due",
    [
        # The daemon's defaults: suspended after 120 s, hibernated 900 s after that.
        (IdlePolicy(), machine_in(RUNNING), 119.9, None),
        (IdlePolicy(), machine_in(RUNNING), 120, PAUSED),
        (IdlePolicy(), machine_in(PAUSED), 1019, None),
        (IdlePolicy(), machine_in(PAUSED), 1020, STOPPED),
        (IdlePolicy(), machine_in(RUNNING), 1020, STOPPED),  # a late pass skips the suspension
        (IdlePolicy(), machine_in(STOPPED), 10**6, None),
        (IdlePolicy(), machine_in(STARTING), 10**6, None),
        # The machine's own limits win over the daemon's.
        (IdlePolicy(), machine_in(RUNNING, 10), 10, PAUSED),
        (IdlePolicy(), machine_in(PAUSED, 10, 5), 14, None),
        (IdlePolicy(), machine_in(PAUSED, 10, 5), 15, STOPPED),
        (IdlePolicy(suspend_after_s=0, hibernate_after_s=0), machine_in(RUNNING, 5), 5, PAUSED),
        # 0 turns a step off.
        (IdlePolicy(), machine_in(RUNNING, 0, 0), 10**6, None),
        (IdlePolicy(suspend_after_s=0, hibernate_after_s=0), machine_in(RUNNING), 10**6, None),
        (IdlePolicy(), machine_in(PAUSED, 120, 0), 10**6, None),
        (IdlePolicy(), machine_in(RUNNING, 120, 0), 120, PAUSED),
        # Hibernate only: straight from running, counted from the last use.
        (IdlePolicy(), machine_in(RUNNING, 0, 60), 59, None),
        (IdlePolicy(), machine_in(RUNNING, 0, 60), 60, STOPPED),
    ],
)
def test_step_due(policy, machine, idle_s, due):
    assert policy.step_due(machine, idle_s) is due


# -- the daemon's idle passes ------------------------------------------------------------


async def test_an_idle_machine_is_suspended_then_hibernated(plane, alice, clock):
    machine = await ready_machine(alice, "idler")
    await alice.get("/v1/machines/idler")  # its last use, at the clock's now
    clock.advance(119)
    await plane.machines.enforce_idle_policy()
    assert await state_of(alice, "idler") == "running"

    clock.advance(1)
    await plane.machines.enforce_idle_policy()
    assert await state_of(alice, "idler") == "paused"
    assert (await plane.runtime.info(machine["id"])).state is VMState.PAUSED

    clock.advance(899)
    await plane.machines.enforce_idle_policy()
    assert await state_of(alice, "idler") == "paused"  # listing it is no use of it
    clock.advance(1)
    await plane.machines.enforce_idle_policy()
    assert await state_of(alice, "idler") == "stopped"
    info = await plane.runtime.info(machine["id"])
    assert info.state is VMState.STOPPED and info.pid is None and info.url_port is None


async def test_a_busy_machine_is_never_idle(plane, alice, clock):
    await ready_machine(alice, "busy")
    await ready_machine(alice, "idle")
    await plane.machines.enforce_idle_policy()  # both seen now
    stream = plane.machines.exec_stream("alice", "busy", ExecBody(cmd="echo working"))
    assert (await anext(stream)).type == "started"  # the command is under way

    clock.advance(10**6)
    await plane.machines.enforce_idle_policy()
    assert await state_of(alice, "busy") == "running"
    assert await state_of(alice, "idle") == "stopped"

    events = [item async for item in stream]
    assert events[-1].type == "exit" and events[-1].exit_code == 0
    clock.advance(120)  # idle time counts from the command's end
    await plane.machines.enforce_idle_policy()
    assert await state_of(alice, "busy") == "paused"


async def test_a_machine_with_idle_steps_off_is_never_suspended(plane, alice, clock):
    await ready_machine(alice, "always-on", suspend_after_s=0, hibernate_after_s=0)
    await ready_machine(alice, "defaults")
    await plane.machines.enforce_idle_policy()
    clock.advance(10**6)
    await plane.machines.enforce_idle_policy()
    assert await state_of(alice, "always-on") == "running"
    assert await state_of(alice, "defaults") == "stopped"


async def test_the_idle_watch_runs_by_itself(tmp_path):
    plane = ControlPlane(tmp_path, idle=IdlePolicy(suspend_after_s=0.05, hibernate_after_s=0, check_every_s=0.01))
    try:
        async with plane.http(plane.key_for("alice")) as alice:
            await ready_machine(alice, "idler")
            plane.machines.start_idle_watch()
            for _ in range(500):
                if await state_of(alice, "idler") == "paused":
                    break
                await asyncio.sleep(0.01)
            assert await state_of(alice, "idler") == "paused"
    finally:
        await plane.close()


# -- waking on use -----------------------------------------------------------------------


async def _exec(client, name):
    response = await client.post(f"/v1/machines/{name}/exec", json={"cmd": "echo awake"})
    assert response.status_code == 200, response.text
    assert base64.b64decode(response.json()["stdout_b64"]) == b"awake\n"


async def _upload(client, name):
    response = await client.put(f"/v1/machines/{name}/files", params={"path": "/new"}, content=b"written")
    assert response.status_code == 200, response.text


async def _download(client, name):
    response = await client.get(f"/v1/machines/{name}/files", params={"path": "/kept"})
    assert response.status_code == 200 and response.content == b"kept", response.text


async def _fork(client, name):
    response = await client.post(f"/v1/machines/{name}/fork", json={"name": "child"})
    assert response.status_code == 201, response.text
    await client.post("/v1/machines/child/wait")
    copied = await client.get("/v1/machines/child/files", params={"path": "/kept"})
    assert copied.content == b"kept"


async def _checkpoint(client, name):
    response = await client.post(f"/v1/machines/{name}/checkpoints", json={"name": "c1"})
    assert response.status_code == 201, response.text


async def _wait(client, name):
    # Waiting for a machine to be ready is a use too: it never answers "paused".
    response = await client.post(f"/v1/machines/{name}/wait")
    assert response.status_code == 200 and response.json()["state"] == "running", response.text


@pytest.mark.parametrize("use", [_exec, _upload, _download, _fork, _checkpoint, _wait],
                         ids=lambda use: use.__name__[1:])
@pytest.mark.parametrize("step", ["suspend", "hibernate"])
async def test_a_use_wakes_a_suspended_or_hibernated_machine(plane, alice, step, use):
    machine = await ready_machine(alice, "sleeper")
    await alice.put("/v1/machines/sleeper/files", params={"path": "/kept"}, content=b"kept")
    slept = await alice.post(f"/v1/machines/sleeper/{step}")
    assert slept.status_code == 200 and slept.json()["state"] == {"suspend": "paused", "hibernate": "stopped"}[step]

    await use(alice, "sleeper")

    await alice.post("/v1/machines/sleeper/wait")  # a hibernated one starts again first
    assert await state_of(alice, "sleeper") == "running"
    assert (await plane.runtime.info(machine["id"])).state is VMState.RUNNING
    kept = await alice.get("/v1/machines/sleeper/files", params={"path": "/kept"})
    assert kept.content == b"kept"  # its files came through


async def test_waking_from_hibernation_respects_the_quota(plane):
    async with plane.http(plane.key_for("tight", max_machines=1)) as client:
        await ready_machine(client, "first")
        assert (await client.post("/v1/machines/first/hibernate")).json()["state"] == "stopped"
        await ready_machine(client, "second")  # a hibernated machine holds no quota

        for path, body in (("/v1/machines/first/exec", {"cmd": "true"}), ("/v1/machines/first/resume", None)):
            refused = await client.post(path, json=body)
            assert refused.status_code == 429 and error_of(refused)["code"] == "quota_exceeded"
            assert await state_of(client, "first") == "stopped"

        await client.delete("/v1/machines/second")
        woken = await client.post("/v1/machines/first/exec", json={"cmd": "echo back"})
        assert base64.b64decode(woken.json()["stdout_b64"]) == b"back\n"


async def test_listing_shows_idle_states_and_wakes_nothing(plane, alice):
    await ready_machine(alice, "paused-one")
    await ready_machine(alice, "stopped-one")
    await alice.post("/v1/machines/paused-one/suspend")
    await alice.post("/v1/machines/stopped-one/hibernate")
    for _ in range(2):
        listed = {m["name"]: m["state"] for m in (await alice.get("/v1/machines")).json()}
        assert listed == {"paused-one": "paused", "stopped-one": "stopped"}
    states = {vm.state for vm in plane.runtime.host.vms.values()}
    assert states == {VMState.PAUSED, VMState.STOPPED}


# -- the explicit routes -----------------------------------------------------------------


async def test_suspend_hibernate_and_resume_routes(plane, alice):
    machine = await ready_machine(alice, "manual")
    suspended = await alice.post("/v1/machines/manual/suspend")
    assert suspended.status_code == 200 and suspended.json()["state"] == "paused"
    assert (await plane.runtime.info(machine["id"])).state is VMState.PAUSED

    resumed = await alice.post(f"/v1/machines/{machine['id']}/resume")
    assert resumed.status_code == 200 and resumed.json()["state"] == "running"
    assert (await plane.runtime.info(machine["id"])).state is VMState.RUNNING

    hibernated = await alice.post("/v1/machines/manual/hibernate")
    assert hibernated.status_code == 200 and hibernated.json()["state"] == "stopped"
    again = await alice.post("/v1/machines/manual/hibernate")  # already so: nothing to do
    assert again.status_code == 200 and again.json()["state"] == "stopped"
    assert (await plane.runtime.info(machine["id"])).state is VMState.STOPPED

    woken = await alice.post("/v1/machines/manual/resume")
    assert woken.status_code == 200 and woken.json()["state"] in ("starting", "running")
    assert (await alice.post("/v1/machines/manual/wait")).json()["state"] == "running"
    assert (await plane.runtime.info(machine["id"])).state is VMState.RUNNING


@pytest.mark.parametrize("step", ["suspend", "hibernate", "resume"])
async def test_idle_routes_find_only_the_accounts_own_machines(plane, alice, step):
    machine = await ready_machine(alice, "mine")
    missing = await alice.post(f"/v1/machines/nope/{step}")
    assert missing.status_code == 404 and error_of(missing)["code"] == "not_found"
    async with plane.http(plane.key_for("bob")) as bob:
        for ref in (machine["id"], "mine"):
            other = await bob.post(f"/v1/machines/{ref}/{step}")
            assert other.status_code == 404 and error_of(other)["code"] == "not_found"
    assert await state_of(alice, "mine") == "running"


# -- machine URLs ------------------------------------------------------------------------


@dataclass
class Received:
    method: str
    path: str
    headers: dict[str, str]
    body: bytes


class Upstream:
    """An HTTP server on 127.0.0.1 standing in for the app inside a machine."""

    def __init__(self) -> None:
        self.received: list[Received] = []
        upstream = self

        class Handler(BaseHTTPRequestHandler):
            def answer(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length") or 0))
                upstream.received.append(
                    Received(self.command, self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                )
                reply = b"from the machine: " + body
                self.send_response(201 if self.command == "POST" else 200)
                self.send_header("content-type", "text/plain")
                self.send_header("x-app", "inside")
                self.send_header("set-cookie", "first=1")
                self.send_header("set-cookie", "second=2")
                self.send_header("content-length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            do_GET = do_POST = answer

            def log_message(self, *args) -> None:  # quiet
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.port = self.server.server_address[1]
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def upstream():
    server = Upstream()
    yield server
    server.close()


@pytest.fixture
async def web(tmp_path, upstream):
    """A daemon whose machines' URLs lead to ``upstream``."""
    plane = ControlPlane(tmp_path, FakeRuntime(url_port=upstream.port), url_format=URL_FORMAT)
    yield plane
    await plane.close()


async def test_a_machine_url_with_the_key_reaches_the_app(web, upstream):
    async with web.http(web.key_for("alice")) as alice:
        machine = await ready_machine(alice, "site")
        assert machine["url"] == "http://site.localhost:7345/"

        response = await alice.post(
            "http://site.localhost:7345/api/echo?q=1&r=two", content=b"payload", headers={"x-client": "yes"}
        )
    assert response.status_code == 201
    assert response.content == b"from the machine: payload"
    assert response.headers["x-app"] == "inside"
    assert response.headers.get_list("set-cookie") == ["first=1", "second=2"]
    (received,) = upstream.received
    assert (received.method, received.path, received.body) == ("POST", "/api/echo?q=1&r=two", b"payload")
    assert received.headers["x-client"] == "yes"
    assert "authorization" not in received.headers  # the account's key stays with boxd


async def test_the_path_reaches_the_app_as_it_was_sent(web, upstream):
    async with web.http(web.key_for("alice")) as alice:
        await ready_machine(alice, "site")
        for target in ("/files/a%2Fb%3Fc%20d", "/plain", "/?only=query"):
            assert (await alice.get(f"http://site.localhost:7345{target}")).status_code == 200
    assert [r.path for r in upstream.received] == ["/files/a%2Fb%3Fc%20d", "/plain", "/?only=query"]


async def test_a_request_without_a_body_goes_without_one(web, upstream):
    async with web.http(web.key_for("alice")) as alice:
        await ready_machine(alice, "site")
        assert (await alice.get("http://site.localhost:7345/")).status_code == 200
    (received,) = upstream.received
    assert "transfer-encoding" not in received.headers and received.body == b""


async def test_one_visitors_cookies_never_reach_the_app_for_another(web, upstream):
    async with web.http(web.key_for("alice")) as alice:
        await ready_machine(alice, "open", public=True)
    async with web.http() as first_visitor:
        await first_visitor.get("http://open.localhost:7345/login")  # the app sets cookies
        assert first_visitor.cookies  # they came back to the visitor
    async with web.http() as second_visitor:
        await second_visitor.get("http://open.localhost:7345/page")
    assert [r.headers.get("cookie") for r in upstream.received] == [None, None]


async def test_a_machine_url_without_the_key_is_401_and_reaches_nothing(web, upstream):
    async with web.http(web.key_for("alice")) as alice:
        await ready_machine(alice, "site")
    async with web.http() as anonymous:
        for host in ("site", "nope"):  # an unknown machine looks the same
            response = await anonymous.get(f"http://{host}.localhost:7345/")
            assert response.status_code == 401 and error_of(response)["code"] == "unauthorized"
    async with web.http(web.key_for("bob")) as bob:
        assert (await bob.get("http://site.localhost:7345/")).status_code == 404
    assert upstream.received == []


async def test_a_public_machine_gets_its_own_authorization_but_never_a_boxd_key(web, upstream):
    async with web.http(web.key_for("alice")) as alice:
        await ready_machine(alice, "open", public=True)
    async with web.http() as visitor:
        app_login = await visitor.get("http://open.localhost:7345/", headers={"authorization": "Basic dXNlcjpwdw=="})
        assert app_login.status_code == 200
    async with web.http(web.key_for("bob")) as bob:  # a valid key of another account
        assert (await bob.get("http://open.localhost:7345/")).status_code == 200
    first, second = upstream.received
    assert first.headers["authorization"] == "Basic dXNlcjpwdw=="  # the app's own, passed on
    assert "authorization" not in second.headers  # bob's boxd key stays with boxd


async def test_a_public_machine_answers_without_a_key_by_id_and_by_name(web, upstream):
    async with web.http(web.key_for("alice")) as alice:
        machine = await ready_machine(alice, "open", public=True)
        assert machine["public"] is True
    async with web.http() as anonymous:
        for label in (machine["id"], "open"):
            response = await anonymous.get(f"http://{label}.localhost:7345/page")
            assert response.status_code == 200 and response.content == b"from the machine: "
    assert [r.path for r in upstream.received] == ["/page", "/page"]


async def test_a_name_public_in_two_accounts_needs_the_id(web, upstream):
    ids = []
    for account in ("alice", "bob"):
        async with web.http(web.key_for(account)) as client:
            ids.append((await ready_machine(client, "twin", public=True))["id"])
    async with web.http() as anonymous:
        assert (await anonymous.get("http://twin.localhost:7345/")).status_code == 401
        assert (await anonymous.get(f"http://{ids[1]}.localhost:7345/")).status_code == 200
    assert len(upstream.received) == 1


async def test_a_machine_url_with_nothing_listening_is_502(tmp_path):
    plane = ControlPlane(tmp_path, FakeRuntime(url_port=free_port()), url_format=URL_FORMAT)
    try:
        async with plane.http(plane.key_for("alice")) as alice:
            await ready_machine(alice, "silent")
            response = await alice.get("http://silent.localhost:7345/")
        assert response.status_code == 502 and error_of(response)["code"] == "bad_gateway"
    finally:
        await plane.close()


@pytest.mark.parametrize("step", ["suspend", "hibernate"])
async def test_a_request_to_a_sleeping_machines_url_wakes_it(web, upstream, step):
    async with web.http(web.key_for("alice")) as alice:
        machine = await ready_machine(alice, "site")
        await alice.post(f"/v1/machines/site/{step}")
        response = await alice.get("http://site.localhost:7345/wake")
        assert response.status_code == 200
        assert await state_of(alice, "site") == "running"
    assert (await web.runtime.info(machine["id"])).state is VMState.RUNNING
    assert [r.path for r in upstream.received] == ["/wake"]


async def test_a_machine_url_request_counts_as_use(web, upstream, clock):
    async with web.http(web.key_for("alice")) as alice:
        await ready_machine(alice, "site")
        await alice.get("/v1/machines/site")
        clock.advance(100)
        assert (await alice.get("http://site.localhost:7345/")).status_code == 200
        clock.advance(100)  # 200 s since the get, 100 s since the page
        await web.machines.enforce_idle_policy()
        assert await state_of(alice, "site") == "running"


async def test_the_api_still_answers_on_localhost_without_a_label(web, upstream):
    async with web.http(web.key_for("alice")) as alice:
        await ready_machine(alice, "site")
        for host in ("localhost:7345", "localhost", "127.0.0.1:7345"):
            response = await alice.get(f"http://{host}/v1/machines")
            assert response.status_code == 200 and [m["name"] for m in response.json()] == ["site"]
    assert upstream.received == []


async def test_a_wake_cut_short_by_a_daemon_crash_leaves_the_machine_hibernated(tmp_path):
    plane = ControlPlane(tmp_path, FakeRuntime())
    async with plane.http(plane.key_for("alice")) as alice:
        machine = await ready_machine(alice, "sleeper")
        await alice.put("/v1/machines/sleeper/files", params={"path": "/note"}, content=b"kept")
        await alice.post("/v1/machines/sleeper/hibernate")
    plane.store.wake_machine(machine["id"])  # the daemon died after this, before the runtime woke it
    assert plane.store.find_machine("alice", "sleeper").state is MachineState.STARTING

    restarted = await plane.restarted()
    try:
        assert restarted.store.find_machine("alice", "sleeper").state is MachineState.STOPPED
        async with restarted.http(restarted.key_for("alice")) as alice:
            assert (await alice.get("/v1/machines/sleeper/files", params={"path": "/note"})).content == b"kept"
            assert await state_of(alice, "sleeper") == "running"
    finally:
        await restarted.close()
