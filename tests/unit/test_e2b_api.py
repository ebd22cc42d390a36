"""The E2B-compatible API over the real app and store and a FakeRuntime (whose commands
are host processes): wire shapes, errors, lifecycle, expiry. The real SDK against real
VMs is tests/integration/test_e2b_conformance.py."""

from __future__ import annotations

import asyncio
import base64
import json
import re
import socket
import struct
import urllib.parse
from datetime import UTC, datetime, timedelta

import pytest
from fakes import ControlPlane, FakeRuntime

from boxd.daemon.e2b import envd_wire as wire
from boxd.daemon.e2b.connect import END_STREAM, ConnectError, envelope, parse_message, reset_when_closed, server_stream
from boxd.daemon.e2b.service import parse_metadata_filter
from boxd.errors import AgentUnavailable, InvalidInput, NotFound
from boxd.runtime.agent_client import WATCH_STARTED, ExecEvent

pytestmark = pytest.mark.anyio

E2B = "/e2b"


@pytest.fixture
async def e2b(plane):
    async with plane.http() as client:
        client.headers["X-API-KEY"] = plane.key_for("alice")
        yield client


def sandboxes_of(plane: ControlPlane):
    return plane.app.state.sandboxes


async def new_sandbox(client, **fields) -> dict:
    created = await client.post(f"{E2B}/v2/sandboxes", json={"templateID": "base", **fields})
    assert created.status_code == 201, created.text
    return created.json()


def envd_headers(sandbox: dict) -> dict:
    return {"E2b-Sandbox-Id": sandbox["sandboxID"], "X-Access-Token": sandbox["envdAccessToken"]}


def frames(body: bytes) -> list[tuple[int, dict]]:
    """The envelopes of a Connect stream: (flags, message)."""
    found, offset = [], 0
    while offset < len(body):
        flags, length = struct.unpack(">BI", body[offset : offset + 5])
        found.append((flags, json.loads(body[offset + 5 : offset + 5 + length])))
        offset += 5 + length
    return found


# -- the wire, without a server ----------------------------------------------------------


def test_messages_take_either_spelling_enums_by_name_or_number_and_ignore_unknown_fields():
    start = parse_message(wire.StartRequest, b'{"process": {"cmd": "ls", "args": ["-l"]}, "tag": "t", "future": 1}')
    assert start.process.cmd == "ls" and start.stdin is None and start.tag == "t"
    by_snake = parse_message(wire.WatchDirRequest, b'{"path": "/x", "include_entry": true}')
    by_camel = parse_message(wire.WatchDirRequest, b'{"path": "/x", "includeEntry": true}')
    assert by_snake.include_entry and by_camel.include_entry
    assert parse_message(wire.SendSignalRequest, b'{"process": {"pid": 3}, "signal": "SIGNAL_SIGKILL"}').signal == 9
    assert parse_message(wire.SendSignalRequest, b'{"process": {"pid": 3}, "signal": 15}').signal == 15


def test_bytes_are_base64_in_any_of_its_spellings_and_bad_input_names_its_field():
    payload = bytes(range(250, 256))
    for text in (base64.b64encode(payload).decode(), base64.urlsafe_b64encode(payload).decode().rstrip("=")):
        message = parse_message(wire.SendInputRequest, json.dumps({"process": {"pid": 1}, "input": {"stdin": text}}).encode())
        assert message.input.data() == payload
    with pytest.raises(ConnectError) as bad:
        parse_message(wire.SendInputRequest, b'{"process": {"pid": 1}, "input": {"stdin": "***"}}')
    assert bad.value.code == "invalid_argument" and "input.stdin" in bad.value.message
    with pytest.raises(ConnectError) as missing:
        parse_message(wire.StartRequest, b'{"process": {}}')
    assert "process.cmd" in missing.value.message


def test_metadata_filters_come_doubly_encoded():
    # What the SDK sends: urlencode({quote(k): quote(v)}), then encoded once more as a query value.
    inner = urllib.parse.urlencode({urllib.parse.quote("a b"): urllib.parse.quote("x&y=z"), "k": "v"})
    assert parse_metadata_filter(inner) == {"a b": "x&y=z", "k": "v"}
    assert parse_metadata_filter(None) == {}


@pytest.mark.parametrize("error, finished", [
    (AgentUnavailable("machine m: the agent connection was lost during exec"), False),
    (NotFound("process with pid 7 not found"), True),
])
async def test_a_stream_whose_sandbox_went_away_is_cut_and_any_other_error_ends_it(error, finished):
    async def events():
        yield wire.Empty()
        raise error

    sent = []

    async def send(message):
        sent.append(message)

    await server_stream(events)({"type": "http", "asgi": {"spec_version": "2.4"}}, None, send)
    bodies = [message for message in sent if message["type"] == "http.response.body"]
    messages = frames(b"".join(message["body"] for message in bodies))
    # Cut: no end message and an unfinished response, which the server ends by closing the
    # connection, as E2B's proxy does for a sandbox that is gone (the SDKs then ask /health).
    assert messages[0] == (0, {}) and (bodies[-1]["more_body"] is False) == finished
    if finished:
        assert messages[-1] == (END_STREAM, {"error": {"code": "not_found", "message": error.message}})
    else:
        assert len(messages) == 1


def test_a_cut_connection_is_reset_not_just_closed():
    # What the SDKs need to see a dropped connection (and ask /health): a reset, not an EOF.
    with socket.create_server(("127.0.0.1", 0)) as listener:
        client = socket.create_connection(listener.getsockname())
        served, _ = listener.accept()
        with client:
            reset_when_closed({"client": served.getpeername(), "server": served.getsockname()})
            served.close()
            with pytest.raises(ConnectionResetError):
                client.settimeout(5)
                client.recv(1)


def test_an_envelope_is_one_write_with_its_length():
    framed = envelope({"a": 1}, END_STREAM)
    assert framed[0] == END_STREAM and struct.unpack(">I", framed[1:5])[0] == len(framed) - 5


# -- the control plane -------------------------------------------------------------------


async def test_create_get_list_and_kill_answer_in_e2b_shapes(plane, e2b):
    first = await new_sandbox(e2b, metadata={"team": "rl", "run": "1"}, envVars={"A": "1"})
    assert {"templateID", "sandboxID", "clientID", "envdVersion", "envdAccessToken"} <= first.keys()
    second = await new_sandbox(e2b, metadata={"team": "rl", "run": "2"})
    assert first["envdAccessToken"] != second["envdAccessToken"]

    info = (await e2b.get(f"{E2B}/sandboxes/{first['sandboxID']}")).json()
    assert info["state"] == "running" and info["metadata"] == {"team": "rl", "run": "1"}
    assert {"startedAt", "endAt", "cpuCount", "memoryMB", "diskSizeMB"} <= info.keys()

    wanted = urllib.parse.urlencode({"run": "2"})
    listed = await e2b.get(f"{E2B}/v2/sandboxes", params={"metadata": wanted})
    assert [s["sandboxID"] for s in listed.json()] == [second["sandboxID"]]
    page = await e2b.get(f"{E2B}/v2/sandboxes", params={"limit": 1})  # newest first
    assert [s["sandboxID"] for s in page.json()] == [second["sandboxID"]]
    assert page.headers["x-next-token"] == first["sandboxID"]
    rest = await e2b.get(f"{E2B}/v2/sandboxes", params={"limit": 1, "nextToken": page.headers["x-next-token"]})
    assert [s["sandboxID"] for s in rest.json()] == [first["sandboxID"]] and "x-next-token" not in rest.headers

    assert (await e2b.delete(f"{E2B}/sandboxes/{first['sandboxID']}")).status_code == 204
    gone = await e2b.get(f"{E2B}/sandboxes/{first['sandboxID']}")
    assert gone.status_code == 404 and gone.json() == {"code": 404, "message": f"sandbox {first['sandboxID']} was not found"}


async def test_bad_requests_are_refused_in_e2b_shape_and_change_nothing(plane, e2b):
    missing = await e2b.post(f"{E2B}/v2/sandboxes", json={"timeout": 5})
    assert missing.status_code == 400 and missing.json()["code"] == 400 and "templateID" in missing.json()["message"]
    negative = await e2b.post(f"{E2B}/v2/sandboxes", json={"templateID": "base", "timeout": -1})
    assert negative.status_code == 400 and "timeout" in negative.json()["message"]
    unknown = await e2b.post(f"{E2B}/v2/sandboxes", json={"templateID": "no-such-template"})
    assert unknown.status_code == 404 and "templateID" not in unknown.json()  # int code, message only
    assert plane.store.list_machines("alice") == []

    wrong_key = await e2b.get(f"{E2B}/v2/sandboxes", headers={"X-API-KEY": "boxd_" + "0" * 48})
    assert wrong_key.status_code == 401 and wrong_key.json()["code"] == 401
    assert wrong_key.headers.get("should-retry") is None
    not_served = await e2b.get(f"{E2B}/volumes")
    assert not_served.status_code == 404 and "not supported" in not_served.json()["message"]


async def test_pause_then_connect_resumes_and_a_second_pause_conflicts(plane, e2b):
    sandbox = await new_sandbox(e2b)
    url = f"{E2B}/sandboxes/{sandbox['sandboxID']}"
    assert (await e2b.post(f"{url}/pause")).status_code == 204
    assert (await e2b.get(url)).json()["state"] == "paused"
    # What the SDKs' is_running() asks: a paused sandbox is not running.
    health = await e2b.get(f"{E2B}/health", headers=envd_headers(sandbox))
    assert health.status_code == 502 and "was not found" in health.json()["message"]
    assert (await e2b.post(f"{url}/pause")).status_code == 409
    resumed = await e2b.post(f"{E2B}/v2/sandboxes/{sandbox['sandboxID']}/connect", json={"timeout": 60})
    assert resumed.status_code == 201 and resumed.json()["envdAccessToken"] == sandbox["envdAccessToken"]
    again = await e2b.post(f"{E2B}/sandboxes/{sandbox['sandboxID']}/connect", json={"timeout": 60})
    assert again.status_code == 200 and (await e2b.get(url)).json()["state"] == "running"
    assert (await e2b.get(f"{E2B}/health", headers=envd_headers(sandbox))).status_code == 204


async def test_a_sandbox_past_its_time_is_killed_or_paused_if_it_asked(plane, e2b):
    doomed = await new_sandbox(e2b, timeout=600)
    keeper = await new_sandbox(e2b, timeout=600, autoPause=True)
    lasting = await new_sandbox(e2b, timeout=600)
    for sandbox in (doomed, keeper):
        assert (await e2b.post(f"{E2B}/sandboxes/{sandbox['sandboxID']}/timeout", json={"timeout": 1})).status_code == 204
    await asyncio.sleep(1.1)
    await sandboxes_of(plane).enforce_expiry()
    assert (await e2b.get(f"{E2B}/sandboxes/{doomed['sandboxID']}")).status_code == 404
    assert (await e2b.get(f"{E2B}/sandboxes/{keeper['sandboxID']}")).json()["state"] == "paused"
    assert (await e2b.get(f"{E2B}/sandboxes/{lasting['sandboxID']}")).json()["state"] == "running"
    await sandboxes_of(plane).enforce_expiry()  # a paused one has no expiry until resumed
    assert (await e2b.get(f"{E2B}/sandboxes/{keeper['sandboxID']}")).json()["state"] == "paused"


async def test_a_fork_of_count_n_answers_one_result_per_child_each_on_its_own(tmp_path):
    plane = ControlPlane(tmp_path)
    try:
        async with plane.http() as client:
            client.headers["X-API-KEY"] = plane.key_for("bob", max_machines=3)
            source = await new_sandbox(client)
            answer = await client.post(f"{E2B}/sandboxes/{source['sandboxID']}/fork", json={"count": 3})
            assert answer.status_code == 201
            results = answer.json()
            children = [r["sandbox"] for r in results if "sandbox" in r]
            errors = [r["error"] for r in results if "error" in r]
            # The quota (3) holds the source and two children; the third is refused alone.
            assert len(children) == 2 and [e["code"] for e in errors] == [429]
            assert len({c["sandboxID"] for c in children} | {source["sandboxID"]}) == 3
            assert len({c["envdAccessToken"] for c in children}) == 2
    finally:
        await plane.close()


async def test_what_boxd_does_not_do_is_refused_naming_the_field_and_makes_nothing(plane, e2b):
    refused = {
        "network.allowOut": {"network": {"allowOut": ["1.1.1.1"], "denyOut": ["0.0.0.0/0"]}},
        "network.denyOut": {"network": {"denyOut": ["8.8.8.8"]}},
        "network.maskRequestHost": {"network": {"maskRequestHost": "custom-host.example.com:${PORT}"}},
        "network.egressProxy": {"network": {"egressProxy": {"address": "proxy:1080"}}},
        "network.rules": {"network": {"rules": {"api.example.com": [{"transform": {"headers": {"a": "b"}}}]}}},
        "network.httpsPorts": {"network": {"httpsPorts": [8443]}},
        "mcp": {"mcp": {"server": {}}},
        "volumeMounts": {"volumeMounts": [{"name": "vol", "path": "/data"}]},
        "iam.tokens": {"iam": {"tokens": {"aws": {"audience": "sts", "tokenType": "JWT-SVID"}}}},
        "autoResume.enabled": {"autoPause": True, "autoResume": {"enabled": True}},
        "body: unknown field(s) futureFence": {"futureFence": {"on": True}},
        "network: unknown field(s) futureRule": {"network": {"futureRule": 1}},
    }
    for field, body in refused.items():
        answer = await e2b.post(f"{E2B}/v2/sandboxes", json={"templateID": "base", **body})
        assert answer.status_code == 400 and answer.json()["code"] == 400, (field, answer.text)
        assert answer.json()["message"].startswith(field), (field, answer.json()["message"])
    assert plane.store.list_machines("alice") == []


async def test_what_boxd_does_or_what_asks_for_nothing_is_accepted(plane, e2b):
    # Denying all egress is an isolated machine, as allow_internet_access=False is.
    # e2b 2.45 sends allowPublicTraffic (E2B's default, true) with any network option.
    fenced = await new_sandbox(e2b, network={"denyOut": ["0.0.0.0/0"], "allowPublicTraffic": True})
    offline = await new_sandbox(e2b, allow_internet_access=False)
    harmless = await new_sandbox(e2b, secure=False, mcp=None, volumeMounts=[], iam={"tokens": {}},
                                 autoResume={"enabled": False},
                                 network={"allowOut": [], "dnsServers": [], "allowPublicTraffic": False})
    isolation = {m.id: m.isolated for m in plane.store.list_machines("alice")}
    assert isolation == {fenced["sandboxID"]: True, offline["sandboxID"]: True, harmless["sandboxID"]: False}


async def test_pause_resume_snapshot_and_refresh_bodies_are_read_not_ignored(plane, e2b):
    sandbox = await new_sandbox(e2b, timeout=600)
    url = f"{E2B}/sandboxes/{sandbox['sandboxID']}"
    no_memory = await e2b.post(f"{url}/snapshots", json={"memory": False})
    assert no_memory.status_code == 400 and no_memory.json()["message"].startswith("memory:")
    assert (await e2b.post(f"{url}/pause", json={"requireHealthyGuest": True})).status_code == 204
    reboot = await e2b.post(f"{E2B}/v2/sandboxes/{sandbox['sandboxID']}/connect", json={"timeout": 60, "memory": False})
    assert reboot.status_code == 400 and reboot.json()["message"].startswith("memory:")
    # Resuming can switch the sandbox to pausing when its time runs out.
    assert (await e2b.post(f"{url}/resume", json={"timeout": 600, "autoPause": True})).status_code == 201
    assert (await e2b.post(f"{url}/refreshes", json={"duration": 1200})).status_code == 204
    end_at = datetime.fromisoformat((await e2b.get(url)).json()["endAt"])
    assert 1100 < (end_at - datetime.now(UTC)).total_seconds() <= 1200
    await e2b.post(f"{url}/timeout", json={"timeout": 1})
    await asyncio.sleep(1.1)
    await sandboxes_of(plane).enforce_expiry()
    assert (await e2b.get(url)).json()["state"] == "paused"


async def test_a_list_is_newest_first_unless_asked_and_filters_by_start_and_template(plane, e2b):
    older = await new_sandbox(e2b, metadata={"run": "x"})
    newer = await new_sandbox(e2b, metadata={"run": "x"}, templateID="boxd")

    async def listed(**params) -> list[str]:
        answer = await e2b.get(f"{E2B}/v2/sandboxes", params={"metadata": "run=x", **params})
        assert answer.status_code == 200, answer.text
        return [s["sandboxID"] for s in answer.json()]

    assert await listed() == await listed(order="desc") == [newer["sandboxID"], older["sandboxID"]]
    assert await listed(order="asc") == [older["sandboxID"], newer["sandboxID"]]
    # What the SDK sends back: a sandbox's own startedAt, in local time, is "at or after" it.
    started = datetime.fromisoformat((await e2b.get(f"{E2B}/sandboxes/{newer['sandboxID']}")).json()["startedAt"])
    assert await listed(startedAfter=started.astimezone().isoformat()) == [newer["sandboxID"]]
    assert await listed(startedAfter=(started + timedelta(seconds=1)).isoformat()) == []
    # "base" and "boxd" both name boxd's image.
    assert await listed(template="base") == [newer["sandboxID"], older["sandboxID"]]
    assert await listed(template="unknown-template") == []
    bad = await e2b.get(f"{E2B}/v2/sandboxes", params={"order": "newest"})
    assert bad.status_code == 400 and bad.json()["message"].startswith("order:")


async def test_snapshots_take_e2b_names_and_list_by_name_in_pages(plane, e2b):
    sandbox = await new_sandbox(e2b)
    url = f"{E2B}/sandboxes/{sandbox['sandboxID']}/snapshots"
    # The names E2B's own tests use: "snap-" + "test_" + 8 random characters.
    named = await e2b.post(url, json={"name": "snap-filter-test_ab12cd34"})
    assert named.status_code == 201, named.text
    assert named.json()["names"] == ["snap-filter-test_ab12cd34"]
    unnamed = (await e2b.post(url, json={})).json()
    for bad in ("team/snap", "snap:v1", "snap.x", "", "s" * 64):
        refused = await e2b.post(url, json={"name": bad})
        assert refused.status_code == 400 and "letters, digits, '-' or '_'" in refused.json()["message"], bad
    # boxd's own API keeps its rule.
    async with plane.http(plane.key_for("alice")) as boxd:
        own = await boxd.post("/v1/snapshots", json={"machine": sandbox["sandboxID"], "name": "snap_x"})
        assert own.status_code == 422

    child = await new_sandbox(e2b, templateID=named.json()["snapshotID"])
    assert (await e2b.get(f"{E2B}/sandboxes/{child['sandboxID']}")).json()["templateID"] == named.json()["snapshotID"]

    async def listed(**params) -> tuple[list[str], str | None]:
        answer = await e2b.get(f"{E2B}/snapshots", params=params)
        assert answer.status_code == 200, answer.text
        return [s["snapshotID"] for s in answer.json()], answer.headers.get("x-next-token")

    assert await listed(name="snap-filter-test_ab12cd34") == ([named.json()["snapshotID"]], None)
    assert await listed(name="snap-filter-test_ab12cd34-does-not-exist") == ([], None)
    first, token = await listed(limit=1)
    rest, last = await listed(limit=1, nextToken=token)
    assert last is None and set(first + rest) == {named.json()["snapshotID"], unnamed["snapshotID"]}

    deleted = await e2b.delete(f"{E2B}/templates/{unnamed['snapshotID']}")
    assert deleted.status_code == 204
    assert (await e2b.delete(f"{E2B}/templates/{unnamed['snapshotID']}")).status_code == 404


async def test_a_sandboxs_time_runs_from_when_it_is_up_and_a_timeout_of_0_ends_it_now(tmp_path):
    plane = ControlPlane(tmp_path, FakeRuntime(ready_after=1.5))  # a boot longer than its time
    try:
        async with plane.http() as e2b:
            e2b.headers["X-API-KEY"] = plane.key_for("alice")
            brief = await new_sandbox(e2b, timeout=1)
            await sandboxes_of(plane).enforce_expiry()
            assert (await e2b.get(f"{E2B}/sandboxes/{brief['sandboxID']}")).json()["state"] == "running"
            await asyncio.sleep(1.1)
            await sandboxes_of(plane).enforce_expiry()
            assert (await e2b.get(f"{E2B}/sandboxes/{brief['sandboxID']}")).status_code == 404

            # 0 is "now" in E2B, not "never": killed, or paused if it asked, before the answer.
            doomed = await new_sandbox(e2b)
            keeper = await new_sandbox(e2b, autoPause=True)
            for sandbox in (doomed, keeper):
                url = f"{E2B}/sandboxes/{sandbox['sandboxID']}"
                assert (await e2b.post(f"{url}/timeout", json={"timeout": 0})).status_code == 204
            assert (await e2b.get(f"{E2B}/sandboxes/{doomed['sandboxID']}")).status_code == 404
            assert (await e2b.get(f"{E2B}/sandboxes/{keeper['sandboxID']}")).json()["state"] == "paused"
            # A paused sandbox's time starts again when it is resumed.
            paused = await e2b.post(f"{E2B}/sandboxes/{keeper['sandboxID']}/timeout", json={"timeout": 60})
            assert paused.status_code == 409
            # Where a sandbox starts, E2B refuses no time at all.
            for url in (f"{E2B}/v2/sandboxes", f"{E2B}/sandboxes/{keeper['sandboxID']}/resume"):
                refused = await e2b.post(url, json={"templateID": "base", "timeout": 0})
                assert refused.status_code == 400 and refused.json()["message"].startswith("timeout:"), url
    finally:
        await plane.close()


async def test_a_key_works_spelled_as_e2b_sdks_2_25_to_2_45_demand_and_only_on_the_e2b_api(plane):
    key = plane.key_for("alice")
    e2b_key = "e2b_" + key.removeprefix("boxd_")
    assert re.fullmatch(r"e2b_[0-9a-f]+", e2b_key)  # what those SDKs check before sending it
    async with plane.http() as client:
        client.headers["X-API-KEY"] = e2b_key
        sandbox = await new_sandbox(client)
        listed = await client.get(f"{E2B}/v2/sandboxes")
        assert [s["sandboxID"] for s in listed.json()] == [sandbox["sandboxID"]]
        forged = e2b_key[:-1] + ("1" if e2b_key.endswith("0") else "0")  # its id right, its secret not
        assert (await client.get(f"{E2B}/v2/sandboxes", headers={"X-API-KEY": forged})).status_code == 401
        wrong = await client.get(f"{E2B}/v2/sandboxes", headers={"X-API-KEY": "e2b_" + "0" * 48})
        assert wrong.status_code == 401 and wrong.json()["code"] == 401
    # boxd's own API keeps its own spelling.
    async with plane.http(e2b_key) as boxd:
        assert (await boxd.get("/v1/machines")).status_code == 401


async def test_a_pause_without_memory_keeps_the_disk_and_resuming_boots_it(plane, e2b):
    def vm(sandbox: dict):
        return plane.runtime.host.vms[sandbox["sandboxID"]]

    kept, dropped = await new_sandbox(e2b), await new_sandbox(e2b)
    assert (await e2b.post(f"{E2B}/sandboxes/{kept['sandboxID']}/pause", json={})).status_code == 204
    assert (await e2b.post(f"{E2B}/sandboxes/{dropped['sandboxID']}/pause", json={"memory": False})).status_code == 204
    assert vm(kept).memory_kept and not vm(dropped).memory_kept
    for sandbox in (kept, dropped):
        resumed = await e2b.post(f"{E2B}/sandboxes/{sandbox['sandboxID']}/connect", json={"timeout": 60})
        assert resumed.status_code == 201
    assert (vm(kept).boots, vm(dropped).boots) == (1, 2)

    # autoPauseMemory: false makes the pause at the end of its time keep the disk only.
    timed = await new_sandbox(e2b, autoPause=True, autoPauseMemory=False)
    whole = await new_sandbox(e2b, autoPause=True)
    for sandbox in (timed, whole):
        assert (await e2b.post(f"{E2B}/sandboxes/{sandbox['sandboxID']}/timeout", json={"timeout": 0})).status_code == 204
        assert (await e2b.get(f"{E2B}/sandboxes/{sandbox['sandboxID']}")).json()["state"] == "paused"
    assert not vm(timed).memory_kept and vm(whole).memory_kept


# -- envd --------------------------------------------------------------------------------


async def test_a_command_streams_start_output_and_end_as_connect_envelopes(plane, e2b):
    sandbox = await new_sandbox(e2b, envVars={"GREETING": "hello"})
    request = envelope({"process": {"cmd": "/bin/sh", "args": ["-c", "echo $GREETING; exit 4"]}, "stdin": False})
    answer = await e2b.post(f"{E2B}/process.Process/Start", content=request,
                            headers={**envd_headers(sandbox), "content-type": "application/connect+json"})
    assert answer.status_code == 200 and answer.headers["content-type"] == "application/connect+json"
    messages = frames(answer.content)
    events = [m["event"] for flags, m in messages if flags == 0]
    assert "start" in events[0] and events[0]["start"]["pid"] > 0
    output = b"".join(base64.b64decode(e["data"]["stdout"]) for e in events if "data" in e)
    assert output == b"hello\n"
    assert events[-1]["end"] == {"exitCode": 4, "exited": True, "status": "exit status 4", "error": "exit status 4"}
    assert messages[-1] == (END_STREAM, {})


async def test_a_relative_cwd_is_resolved_against_the_users_home(plane, e2b, monkeypatch):
    sandbox = await new_sandbox(e2b)
    cwds = []

    async def exec(vm_id, request):
        cwds.append(request.cwd)
        yield ExecEvent("started", pid=1)
        yield ExecEvent("exit", exit_code=0)

    monkeypatch.setattr(plane.runtime, "exec", exec)
    as_root = {"authorization": "Basic " + base64.b64encode(b"root:").decode()}
    for cwd, user in (("proj/x", {}), ("~/proj", {}), ("proj", as_root), ("/srv", {}), ("", {})):
        started = await e2b.post(f"{E2B}/process.Process/Start",
                                 content=envelope({"process": {"cmd": "true", "cwd": cwd}, "stdin": False}),
                                 headers={**envd_headers(sandbox), **user, "content-type": "application/connect+json"})
        assert started.status_code == 200
    assert cwds == ["/home/user/proj/x", "/home/user/proj", "/root/proj", "/srv", None]


async def test_a_watch_starts_once_the_guest_watches_and_a_folder_it_cannot_watch_is_the_answer(
    plane, e2b, monkeypatch
):
    sandbox = await new_sandbox(e2b)
    refusals = {"/home/user/nowhere": NotFound("path: not a directory", field="path"),
                "/home/user/a-file": InvalidInput("path: not a directory", field="path")}

    async def watch(vm_id, path, *, recursive=False):
        if path in refusals:  # as the agent refuses it, before it says the watch started
            raise refusals[path]
        yield WATCH_STARTED
        yield "a.txt", "create"

    monkeypatch.setattr(plane.runtime, "watch", watch)
    headers = {**envd_headers(sandbox), "content-type": "application/connect+json"}
    rpc = f"{E2B}/filesystem.Filesystem"
    missing = await e2b.post(f"{rpc}/WatchDir", content=envelope({"path": "nowhere"}), headers=headers)
    assert missing.status_code == 404 and missing.json()["code"] == "not_found"
    a_file = await e2b.post(f"{rpc}/WatchDir", content=envelope({"path": "a-file"}), headers=headers)
    assert a_file.status_code == 400 and a_file.json()["code"] == "invalid_argument"
    watched = await e2b.post(f"{rpc}/WatchDir", content=envelope({"path": "watched"}), headers=headers)
    messages = [message for _, message in frames(watched.content)]
    assert messages[0] == {"start": {}} and messages[1]["filesystem"]["name"] == "a.txt"
    assert messages[-1] == {}

    # The sync API's CreateWatcher, likewise.
    unary = {**envd_headers(sandbox), "content-type": "application/json"}
    refused = await e2b.post(f"{rpc}/CreateWatcher", json={"path": "nowhere"}, headers=unary)
    assert refused.status_code == 404 and refused.json()["code"] == "not_found"
    created = await e2b.post(f"{rpc}/CreateWatcher", json={"path": "watched"}, headers=unary)
    watcher = created.json()["watcherId"]
    for _ in range(100):
        drained = (await e2b.post(f"{rpc}/GetWatcherEvents", json={"watcherId": watcher}, headers=unary)).json()
        if drained.get("events"):
            break
        await asyncio.sleep(0.01)
    assert [event["name"] for event in drained["events"]] == ["a.txt"]


async def test_envd_calls_need_the_sandboxs_own_token_and_find_it_by_token_alone(plane, e2b):
    first, second = await new_sandbox(e2b), await new_sandbox(e2b)
    health = f"{E2B}/health"
    assert (await e2b.get(health, headers=envd_headers(first))).status_code == 204
    crossed = {"E2b-Sandbox-Id": first["sandboxID"], "X-Access-Token": second["envdAccessToken"]}
    refused = await e2b.post(f"{E2B}/process.Process/List", json={}, headers=crossed)
    assert refused.status_code == 401 and refused.json()["code"] == "unauthenticated"
    # e2b 2.7's Sandbox.connect sends the token and no sandbox id.
    by_token = await e2b.get(f"{E2B}/files", params={"path": "/nowhere"},
                             headers={"X-Access-Token": second["envdAccessToken"]})
    assert by_token.status_code == 404 and by_token.json()["code"] == 404

    await e2b.delete(f"{E2B}/sandboxes/{first['sandboxID']}")
    # What the SDKs read as "the sandbox is not running": unavailable or 502, "... was not found".
    gone = await e2b.post(f"{E2B}/process.Process/List", json={}, headers=envd_headers(first))
    assert gone.status_code == 503 and gone.json()["code"] == "unavailable" and "was not found" in gone.json()["message"]
    files_gone = await e2b.get(f"{E2B}/files", params={"path": "/x"}, headers=envd_headers(first))
    assert files_gone.status_code == 502 and "was not found" in files_gone.json()["message"]
    assert files_gone.headers["should-retry"] == "false"


async def test_files_go_up_as_multipart_or_octets_and_come_back(plane, e2b):
    sandbox = await new_sandbox(e2b)
    headers = envd_headers(sandbox)
    multipart = await e2b.post(f"{E2B}/files", headers=headers,
                               files=[("file", ("/home/user/a.txt", b"A")), ("file", ("b.txt", b"B"))])
    assert multipart.json() == [{"name": "a.txt", "type": "file", "path": "/home/user/a.txt"},
                                {"name": "b.txt", "type": "file", "path": "/home/user/b.txt"}]
    octets = await e2b.post(f"{E2B}/files", params={"path": "/tmp/c.bin", "username": "root"},
                            headers={**headers, "content-type": "application/octet-stream"}, content=b"\x00\xff")
    assert octets.json() == [{"name": "c.bin", "type": "file", "path": "/tmp/c.bin"}]
    back = await e2b.get(f"{E2B}/files", params={"path": "/tmp/c.bin"}, headers=headers)
    assert back.status_code == 200 and back.content == b"\x00\xff"
    nameless = await e2b.post(f"{E2B}/files", headers={**headers, "content-type": "application/octet-stream"},
                              content=b"x")
    assert nameless.status_code == 400 and "path" in nameless.json()["message"]


async def test_a_stream_that_cannot_start_is_a_plain_connect_error(plane, e2b):
    sandbox = await new_sandbox(e2b)
    bad = await e2b.post(f"{E2B}/process.Process/Start", content=envelope({"process": {"cmd": ""}}),
                         headers={**envd_headers(sandbox), "content-type": "application/connect+json"})
    assert bad.status_code == 400 and bad.json()["code"] == "invalid_argument" and "process.cmd" in bad.json()["message"]
    garbled = await e2b.post(f"{E2B}/process.Process/Start", content=b"\x00\x00\x00\x00\x10{",
                             headers={**envd_headers(sandbox), "content-type": "application/connect+json"})
    assert garbled.status_code == 400 and garbled.json()["code"] == "invalid_argument"
