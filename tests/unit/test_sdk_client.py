"""The SDK, both faces, against the daemon's app: results, errors by code, configuration."""

from __future__ import annotations

import inspect
import io
import json
import multiprocessing
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
from fakes import ControlPlane, daemon_thread, short_home

from boxd import AsyncBoxd, Boxd
from boxd.errors import AuthError, BoxdError, Conflict, InvalidInput, NotFound, QuotaExceeded, Timeout
from boxd.errors import DaemonUnavailable, Forbidden, TooLarge
from boxd.models import ExecResult, Machine, MachineState
from boxd.sdk import async_client, sync_client

home = pytest.fixture(short_home)


def async_sdk(plane: ControlPlane, key: str | None, *, local: bool = False) -> AsyncBoxd:
    return AsyncBoxd(api_key=key, base_url=plane.TCP_URL, transport=plane.transport(local=local))


# -- the async face, in process ----------------------------------------------------------


@pytest.mark.anyio
async def test_async_machine_lifecycle(plane):
    async with async_sdk(plane, plane.key_for("alice")) as boxd:
        machine = await boxd.machines.new("rl-base", vcpus=1, memory_mib=256)
        assert isinstance(machine, Machine) and machine.state is MachineState.STARTING
        ready = await boxd.machines.wait_until_ready(machine.id)
        assert ready.state is MachineState.RUNNING
        assert [m.name for m in await boxd.machines.list()] == ["rl-base"]
        assert (await boxd.machines.get("rl-base")).id == machine.id
        # A Machine object works wherever a name or id does.
        assert (await boxd.machines.get(machine)).name == "rl-base"

        result = await boxd.machines.exec(machine, "echo héllo; echo oops >&2; exit 2")
        assert isinstance(result, ExecResult)
        assert (result.stdout, result.stderr, result.exit_code) == ("héllo\n", "oops\n", 2)
        assert result.stdout_bytes == "héllo\n".encode()
        argv = await boxd.machines.exec("rl-base", ["printf", "%s", "a b"], env={"X": "1"}, stdin=b"")
        assert argv.stdout == "a b"
        binary = await boxd.machines.exec("rl-base", ["printf", "\\377"])
        assert binary.stdout_bytes == b"\xff" and binary.stdout == "\ufffd"
        piped = await boxd.machines.exec("rl-base", "cat", stdin="from stdin")
        assert piped.stdout == "from stdin"
        slow = await boxd.machines.exec("rl-base", "sleep 5", timeout=0.2)
        assert slow.timed_out

        kinds = [e.type async for e in boxd.machines.exec_stream("rl-base", "echo a; echo b >&2")]
        assert kinds[0] == "started" and kinds[-1] == "exit" and {"stdout", "stderr"} <= set(kinds)

        deleted = await boxd.machines.delete(machine)
        assert deleted.state is MachineState.DELETED
        with pytest.raises(NotFound):
            await boxd.machines.get(machine.id)


@pytest.mark.anyio
async def test_async_files(plane, tmp_path):
    async with async_sdk(plane, plane.key_for("alice")) as boxd:
        await boxd.machines.new("files")
        text = "print('rollout')\n"
        written = await boxd.machines.files.upload("files", "/home/boxd/rollout.py", text)
        assert written.size == len(text)
        assert await boxd.machines.files.download("files", "/home/boxd/rollout.py") == text.encode()
        await boxd.machines.files.upload("files", "/b", b"\x00\x01")
        assert await boxd.machines.files.download("files", "/b") == b"\x00\x01"
        big = bytes(range(256)) * 20_000  # several upload chunks
        await boxd.machines.files.upload("files", "/big", io.BytesIO(big))
        destination = tmp_path / "big.out"
        assert await boxd.machines.files.download_to("files", "/big", destination) == len(big)
        assert destination.read_bytes() == big
        with pytest.raises(InvalidInput) as raised:
            await boxd.machines.files.upload("files", "relative", "x")
        assert raised.value.field == "path"
        with pytest.raises(InvalidInput) as raised:
            await boxd.machines.files.upload("files", "/x", 42)  # type: ignore[arg-type]
        assert raised.value.field == "content"


@pytest.mark.anyio
async def test_errors_come_back_as_their_classes(plane):
    async with async_sdk(plane, plane.key_for("quota", max_machines=1)) as boxd:
        await boxd.machines.new("one")
        with pytest.raises(Conflict) as duplicate:
            await boxd.machines.new("one")
        assert duplicate.value.field == "name"
        with pytest.raises(QuotaExceeded) as over:
            await boxd.machines.new("two")
        assert over.value.details == {"limit": 1, "running": 1}
        with pytest.raises(InvalidInput) as bad:
            await boxd.machines.new("Bad Name")
        assert bad.value.field == "name"
        with pytest.raises(NotFound):
            await boxd.machines.exec("missing", "true")
        with pytest.raises(Forbidden):
            await boxd.admin.list_keys()
    async with async_sdk(plane, "boxd_" + "0" * 48) as stranger:
        with pytest.raises(AuthError):
            await stranger.machines.list()


@pytest.mark.anyio
async def test_async_idle_settings_suspend_hibernate_and_resume(plane):
    async with async_sdk(plane, plane.key_for("alice", max_machines=1)) as boxd:
        machine = await boxd.machines.new(
            "web", suspend_after_s=30, hibernate_after_s=0, http_port=3000, public=True
        )
        assert (machine.suspend_after_s, machine.hibernate_after_s) == (30, 0)
        assert (machine.http_port, machine.public) == (3000, True)
        await boxd.machines.wait_until_ready(machine)

        assert (await boxd.machines.suspend(machine)).state is MachineState.PAUSED
        assert (await boxd.machines.resume("web")).state is MachineState.RUNNING
        assert (await boxd.machines.hibernate("web")).state is MachineState.STOPPED
        assert (await boxd.machines.get("web")).state is MachineState.STOPPED  # looking is no use
        assert (await boxd.machines.exec("web", "echo woken")).stdout == "woken\n"
        assert (await boxd.machines.get("web")).state is MachineState.RUNNING

        await boxd.machines.hibernate("web")
        await boxd.machines.new("other")  # a hibernated machine holds no quota
        with pytest.raises(QuotaExceeded):
            await boxd.machines.resume("web")
        with pytest.raises(NotFound):
            await boxd.machines.suspend("missing")


@pytest.mark.anyio
async def test_new_sends_idle_and_url_settings_only_when_asked():
    bodies = []

    def answer(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(400, json={"error": {"code": "invalid_input", "message": "stop here"}})

    async with AsyncBoxd(api_key="k", base_url="http://daemon", transport=httpx.MockTransport(answer)) as boxd:
        for options in ({}, {"suspend_after_s": 0, "hibernate_after_s": 0, "http_port": 3000, "public": True}):
            with pytest.raises(InvalidInput):
                await boxd.machines.new("m", **options)
    plain, asked = bodies
    assert set(plain) == {"name", "vcpus", "memory_mib", "disk_gib", "isolated"}  # an older daemon accepts it
    assert {k: asked[k] for k in ("suspend_after_s", "hibernate_after_s", "http_port", "public")} == {
        "suspend_after_s": 0, "hibernate_after_s": 0, "http_port": 3000, "public": True
    }


@pytest.mark.anyio
async def test_admin_through_the_sdk(plane):
    async with async_sdk(plane, None, local=True) as admin:
        await admin.admin.set_account("team", max_machines=4)
        assert {a.name: a.max_machines for a in await admin.admin.list_accounts()}["team"] == 4
        created = await admin.admin.create_key("team", name="ci")
        assert created.key.startswith("boxd_")
        assert created.id in {k.id for k in await admin.admin.list_keys()}
        assert (await admin.admin.revoke_key(created.id)).revoked_at is not None


@pytest.mark.anyio
@pytest.mark.parametrize(
    "status, body, expected",
    [
        # The class follows the code even when status and wording say otherwise.
        (404, {"error": {"code": "quota_exceeded", "message": "no such machine"}}, QuotaExceeded),
        (500, {"error": {"code": "timeout", "message": "quota exceeded"}}, Timeout),
        (413, {"error": {"code": "too_large", "message": "x", "field": "body"}}, TooLarge),
        (418, {"error": {"code": "from_the_future", "message": "x"}}, BoxdError),
        (502, "<html>bad gateway</html>", BoxdError),
    ],
)
async def test_error_class_is_picked_by_code_never_by_message(status, body, expected):
    def answer(request: httpx.Request) -> httpx.Response:
        if isinstance(body, str):
            return httpx.Response(status, text=body)
        return httpx.Response(status, json=body)

    async with AsyncBoxd(api_key="k", base_url="http://daemon", transport=httpx.MockTransport(answer)) as boxd:
        with pytest.raises(BoxdError) as raised:
            await boxd.machines.list()
    assert type(raised.value) is expected


@pytest.mark.anyio
async def test_a_stream_that_breaks_raises_the_error_it_carries():
    lines = b'{"type":"started","pid":1}\n{"type":"error","error":{"code":"agent_unavailable","message":"lost"}}\n'
    transport = httpx.MockTransport(lambda request: httpx.Response(200, content=lines))
    async with AsyncBoxd(api_key="k", base_url="http://daemon", transport=transport) as boxd:
        from boxd.errors import AgentUnavailable

        seen = []
        with pytest.raises(AgentUnavailable):
            async for item in boxd.machines.exec_stream("m", "true"):
                seen.append(item.type)
        assert seen == ["started"]


@pytest.mark.anyio
async def test_an_unreachable_daemon_is_daemon_unavailable():
    async with AsyncBoxd(api_key="k", base_url="http://127.0.0.1:9") as boxd:
        with pytest.raises(DaemonUnavailable, match="cannot reach"):
            await boxd.health()


# -- configuration -----------------------------------------------------------------------


def test_settings_come_from_arguments_then_environment(monkeypatch, tmp_path):
    monkeypatch.setenv("BOXD_HOME", str(tmp_path))
    monkeypatch.setenv("BOXD_URL", "http://from-env:1")
    monkeypatch.setenv("BOXD_API_KEY", "env-key")
    assert AsyncBoxd().endpoint.base_url == "http://from-env:1"
    assert AsyncBoxd()._api_key == "env-key"
    assert AsyncBoxd(api_key="arg-key", base_url="https://arg")._api_key == "arg-key"
    assert AsyncBoxd(base_url="https://arg").endpoint.base_url == "https://arg"
    monkeypatch.delenv("BOXD_URL")
    local = AsyncBoxd().endpoint
    assert local.uds == tmp_path / "boxd.sock" and local.home == tmp_path
    other = AsyncBoxd(base_url="unix:///run/elsewhere.sock").endpoint
    assert str(other.uds) == "/run/elsewhere.sock" and other.home is None
    with pytest.raises(InvalidInput) as raised:
        Boxd(base_url="ftp://nope")
    assert raised.value.field == "base_url"


def test_every_async_method_has_a_sync_face_with_the_same_parameters():
    pairs = [
        (async_client.AsyncBoxd, sync_client.Boxd),
        (async_client.AsyncMachines, sync_client.Machines),
        (async_client.AsyncFiles, sync_client.Files),
        (async_client.AsyncCheckpoints, sync_client.Checkpoints),
        (async_client.AsyncSnapshots, sync_client.Snapshots),
        (async_client.AsyncAdmin, sync_client.Admin),
    ]
    for async_cls, sync_cls in pairs:
        for name, method in inspect.getmembers(async_cls, inspect.isfunction):
            if name.startswith("_") or name in {"close"}:
                continue
            mirror = getattr(sync_cls, name, None)
            assert mirror is not None, f"{sync_cls.__name__}.{name} is missing"
            assert inspect.signature(mirror).parameters == inspect.signature(method).parameters
            assert mirror.__doc__ == method.__doc__


# -- the sync face, against a real daemon on its unix socket -----------------------------


def test_the_seed_flow_with_the_embedded_default(home, monkeypatch, tmp_path):
    monkeypatch.setenv("BOXD_HOME", str(home))
    monkeypatch.delenv("BOXD_URL", raising=False)
    monkeypatch.delenv("BOXD_API_KEY", raising=False)
    script = tmp_path / "rollout.py"
    script.write_text("print('seeded')\n")
    with daemon_thread(home):
        boxd = Boxd()  # no key, no URL: the local socket and its local key
        boxd.machines.new("rl-base")
        boxd.machines.files.upload("rl-base", "/home/boxd/rollout.py", open(script).read())
        assert boxd.machines.files.download("rl-base", "/home/boxd/rollout.py") == b"print('seeded')\n"

        def rollout(seed: int) -> str:
            boxd.machines.wait_until_ready("rl-base")
            result = boxd.machines.exec("rl-base", f"echo seed-{seed}")
            return result.stdout.strip()

        with ThreadPoolExecutor(max_workers=8) as pool:
            results = list(pool.map(rollout, range(8)))
        assert results == [f"seed-{s}" for s in range(8)]
        events = [e.type for e in boxd.machines.exec_stream("rl-base", ["echo", "x"])]
        assert events == ["started", "stdout", "exit"]
        boxd.machines.delete("rl-base")
        boxd.close()


def test_the_sync_face_suspends_and_wakes(home, monkeypatch):
    monkeypatch.setenv("BOXD_HOME", str(home))
    monkeypatch.delenv("BOXD_URL", raising=False)
    monkeypatch.delenv("BOXD_API_KEY", raising=False)
    with daemon_thread(home) as daemon, Boxd() as boxd:
        machine = boxd.machines.new("web", public=True, suspend_after_s=0)
        assert machine.url == f"http://web.localhost:{daemon.port}/"
        boxd.machines.wait_until_ready(machine)
        assert boxd.machines.suspend("web").state is MachineState.PAUSED
        assert boxd.machines.resume("web").state is MachineState.RUNNING
        assert boxd.machines.hibernate("web").state is MachineState.STOPPED
        boxd.machines.resume("web")
        assert boxd.machines.wait_until_ready("web").state is MachineState.RUNNING


def _health_in_child(queue) -> None:
    queue.put(CLIENT.health().status)


CLIENT: Boxd | None = None


def test_a_forked_child_gets_a_client_of_its_own(home, monkeypatch):
    global CLIENT
    monkeypatch.setenv("BOXD_HOME", str(home))
    monkeypatch.delenv("BOXD_URL", raising=False)
    with daemon_thread(home):
        CLIENT = Boxd()
        assert CLIENT.health().status == "ok"  # the parent's loop thread now runs
        context = multiprocessing.get_context("fork")
        queue = context.Queue()
        child = context.Process(target=_health_in_child, args=(queue,))
        child.start()
        child.join(30)
        assert child.exitcode == 0
        assert queue.get(timeout=1) == "ok"
        CLIENT.close()
