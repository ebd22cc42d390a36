"""The HTTP API through the real FastAPI app and SQLite store, with a FakeRuntime."""

from __future__ import annotations

import asyncio
import base64
import json

import pytest
from fakes import ControlPlane, FakeRuntime

from boxd.daemon.machines import Limits
from boxd.errors import VMLaunchFailure

pytestmark = pytest.mark.anyio


def error_of(response) -> dict:
    return response.json()["error"]


async def new_machine(client, name: str = "rl-base", **fields) -> dict:
    response = await client.post("/v1/machines", json={"name": name, **fields})
    assert response.status_code == 201, response.text
    return response.json()


# -- health and auth ---------------------------------------------------------------------


async def test_health_needs_no_key(plane):
    async with plane.http() as client:
        response = await client.get("/v1/health")
    assert response.status_code == 200
    assert response.json()["status"] == "ok"


@pytest.mark.parametrize(
    "authorization",
    [None, "Bearer boxd_" + "0" * 48, "Bearer nonsense", "Basic dXNlcjpwYXNz", "Bearer "],
    ids=["missing", "unknown", "malformed", "other-scheme", "empty"],
)
async def test_calls_without_a_valid_key_are_401(plane, authorization):
    headers = {"authorization": authorization} if authorization else {}
    async with plane.http() as client:
        response = await client.get("/v1/machines", headers=headers)
    assert response.status_code == 401
    assert error_of(response)["code"] == "unauthorized"


async def test_a_revoked_key_is_401(plane):
    created = plane.keys.mint("local")
    async with plane.http(created.key) as client:
        assert (await client.get("/v1/machines")).status_code == 200
        plane.store.revoke_key(created.id)
        response = await client.get("/v1/machines")
    assert response.status_code == 401


async def test_an_account_sees_only_its_own_machines(plane, alice):
    machine = await new_machine(alice, "shared-name")
    async with plane.http(plane.key_for("bob")) as bob:
        for ref in (machine["id"], machine["name"]):
            assert (await bob.get(f"/v1/machines/{ref}")).status_code == 404
            assert (await bob.delete(f"/v1/machines/{ref}")).status_code == 404
            assert (await bob.post(f"/v1/machines/{ref}/exec", json={"cmd": "true"})).status_code == 404
        assert (await bob.get("/v1/machines")).json() == []
        # Names are per account: bob may use the same one.
        await new_machine(bob, "shared-name")
    assert (await alice.get(f"/v1/machines/{machine['id']}")).status_code == 200


# -- admin -------------------------------------------------------------------------------


async def test_admin_calls_are_403_over_tcp_even_with_a_key(plane, alice):
    for method, path in [("GET", "/v1/admin/keys"), ("POST", "/v1/admin/keys"), ("PUT", "/v1/admin/accounts/x")]:
        response = await alice.request(method, path, json={})
        assert response.status_code == 403, path
        assert error_of(response)["code"] == "forbidden"


async def test_admin_over_the_local_socket(plane):
    async with plane.http(local=True) as admin:
        account = (await admin.put("/v1/admin/accounts/carol", json={"max_machines": 3})).json()
        assert account["max_machines"] == 3
        # Leaving the limit out keeps it.
        assert (await admin.put("/v1/admin/accounts/carol", json={})).json()["max_machines"] == 3
        created = await admin.post("/v1/admin/keys", json={"account": "carol", "name": "ci"})
        assert created.status_code == 201
        key = created.json()
        assert key["key"].startswith("boxd_") and key["key"][5:17] == key["id"]
        listed = (await admin.get("/v1/admin/keys")).json()
        assert {k["id"] for k in listed} >= {key["id"]}
        assert all("key" not in k for k in listed)  # secrets are shown once only
        missing = await admin.post("/v1/admin/keys", json={"account": "nobody"})
        assert missing.status_code == 404 and error_of(missing)["field"] == "account"
        bad = await admin.put("/v1/admin/accounts/Bad_Name", json={})
        assert bad.status_code == 422 and error_of(bad)["field"] == "name"
        revoked = await admin.delete(f"/v1/admin/keys/{key['id']}")
        assert revoked.json()["revoked_at"] is not None
    async with plane.http(key["key"]) as carol:
        assert (await carol.get("/v1/machines")).status_code == 401


async def test_keys_are_stored_hashed(plane):
    created = plane.keys.mint("local")
    raw = plane.store.path.read_bytes() + plane.store.path.with_name("boxd.db-wal").read_bytes()
    assert created.key.encode() not in raw


# -- quota -------------------------------------------------------------------------------


async def test_over_quota_is_429_naming_limit_and_count(plane):
    async with plane.http(plane.key_for("dave", max_machines=2)) as dave:
        await new_machine(dave, "a")
        await new_machine(dave, "b")
        response = await dave.post("/v1/machines", json={"name": "c"})
        assert response.status_code == 429
        error = error_of(response)
        assert error["code"] == "quota_exceeded"
        assert "at most 2" in error["message"] and "2 are running" in error["message"]
        assert error["details"] == {"limit": 2, "running": 2}
        # Deleting frees the slot.
        assert (await dave.delete("/v1/machines/a")).json()["state"] == "deleted"
        await new_machine(dave, "c")


async def test_concurrent_creates_cannot_slip_past_the_quota(tmp_path):
    # A slow boot keeps every machine "starting" while the others are being created.
    plane = ControlPlane(tmp_path, FakeRuntime(ready_after=5))
    try:
        async with plane.http(plane.key_for("erin", max_machines=3)) as erin:
            responses = await asyncio.gather(
                *(erin.post("/v1/machines", json={"name": f"m{i}"}) for i in range(8))
            )
            codes = sorted(r.status_code for r in responses)
            assert codes == [201] * 3 + [429] * 5
            assert len((await erin.get("/v1/machines")).json()) == 3
    finally:
        await plane.close()


# -- names and input ---------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    ["", "a" * 64, "UPPER", "-lead", "trail-", "has/slash", "..", "a.b", "sp ace", "m-0123456789ab", 7],
)
async def test_bad_names_are_422_naming_the_field_and_change_nothing(plane, alice, name):
    response = await alice.post("/v1/machines", json={"name": name})
    assert response.status_code == 422
    error = error_of(response)
    assert error["code"] == "invalid_input" and error["field"] == "name"
    assert error["message"].startswith("name: ")
    assert (await alice.get("/v1/machines")).json() == []
    assert plane.runtime.host.vms == {}


async def test_longest_name_is_fine(alice):
    await new_machine(alice, "a" * 63)


async def test_duplicate_name_is_409_and_a_deleted_name_is_free_again(plane, alice):
    first = await new_machine(alice, "dup")
    response = await alice.post("/v1/machines", json={"name": "dup"})
    assert response.status_code == 409
    assert error_of(response)["field"] == "name"
    assert len(plane.runtime.host.vms) == 1
    await alice.delete(f"/v1/machines/{first['id']}")
    second = await new_machine(alice, "dup")
    assert second["id"] != first["id"]


@pytest.mark.parametrize(
    "fields, field",
    [
        ({"vcpus": 0}, "vcpus"),
        ({"vcpus": 10_000}, "vcpus"),
        ({"memory_mib": 64}, "memory_mib"),
        ({"memory_mib": 10**9}, "memory_mib"),
        ({"disk_gib": 0}, "disk_gib"),
        ({"disk_gib": 257}, "disk_gib"),
        ({"isolated": "maybe"}, "isolated"),
        ({"colour": "blue"}, "colour"),
    ],
)
async def test_bad_sizes_are_422_naming_the_field(plane, alice, fields, field):
    response = await alice.post("/v1/machines", json={"name": "ok", **fields})
    assert response.status_code == 422, response.text
    assert error_of(response)["field"] == field
    assert (await alice.get("/v1/machines")).json() == []


async def test_a_host_that_is_not_up_is_404_naming_the_field_and_changes_nothing(alice):
    # One host here, so no host name is one to start on or fork onto.
    response = await alice.post("/v1/machines", json={"name": "pinned", "host": "boxd-host-elsewhere"})
    assert response.status_code == 404, response.text
    assert error_of(response)["field"] == "host"
    assert (await alice.get("/v1/machines")).json() == []
    source = await new_machine(alice)
    await alice.post(f"/v1/machines/{source['id']}/wait", params={"timeout": 5})
    forked = await alice.post(f"/v1/machines/{source['id']}/fork", json={"name": "away", "host": "boxd-host-elsewhere"})
    assert forked.status_code == 404 and error_of(forked)["field"] == "host"
    assert [m["id"] for m in (await alice.get("/v1/machines")).json()] == [source["id"]]


async def test_malformed_json_is_422(alice):
    response = await alice.post("/v1/machines", content=b"{not json", headers={"content-type": "application/json"})
    assert response.status_code == 422
    assert error_of(response)["code"] == "invalid_input"


async def test_unknown_machine_is_404_everywhere(alice):
    for method, path, body in [
        ("GET", "/v1/machines/nope", None),
        ("DELETE", "/v1/machines/nope", None),
        ("POST", "/v1/machines/nope/exec", {"cmd": "true"}),
        ("POST", "/v1/machines/nope/exec/stream", {"cmd": "true"}),
        ("POST", "/v1/machines/nope/wait", None),
        ("GET", "/v1/machines/nope/files?path=/x", None),
    ]:
        response = await alice.request(method, path, json=body)
        assert response.status_code == 404, path
        assert error_of(response)["code"] == "not_found"


async def test_unknown_route_answers_in_our_error_shape(alice):
    response = await alice.get("/v1/nothing-here")
    assert response.status_code == 404
    assert error_of(response)["code"] == "not_found"


# -- lifecycle ---------------------------------------------------------------------------


async def test_create_get_wait_delete(plane, alice):
    machine = await new_machine(alice, vcpus=1, memory_mib=256, disk_gib=2)
    assert machine["id"].startswith("m-") and len(machine["id"]) == 14
    assert machine["state"] == "starting"
    ready = await alice.post(f"/v1/machines/{machine['name']}/wait", params={"timeout": 5})
    assert ready.status_code == 200 and ready.json()["state"] == "running"
    spec = plane.runtime.host.vms[machine["id"]].spec
    assert (spec.vcpus, spec.memory_mib, spec.disk_gib) == (1, 256, 2)
    assert (await alice.get(f"/v1/machines/{machine['id']}")).json()["name"] == "rl-base"
    deleted = await alice.delete("/v1/machines/rl-base")
    assert deleted.json()["state"] == "deleted"
    assert machine["id"] not in plane.runtime.host.vms
    assert (await alice.get("/v1/machines/rl-base")).status_code == 404


async def test_a_machine_that_cannot_launch_is_failed_with_its_reason(tmp_path):
    launch = VMLaunchFailure("qemu exited at start", exitcode=1, command=["qemu"], output="boom")
    plane = ControlPlane(tmp_path, FakeRuntime(fail_create=launch))
    try:
        async with plane.http(plane.key_for("local")) as client:
            response = await client.post("/v1/machines", json={"name": "x"})
            assert response.status_code == 500
            assert error_of(response)["code"] == "vm_launch_failed"
            (machine,) = (await client.get("/v1/machines")).json()
            assert machine["state"] == "failed" and "qemu exited" in machine["reason"]
            # A failed machine holds no quota.
            assert plane.store.machines_on_host() == []
    finally:
        await plane.close()


async def test_wait_on_a_machine_that_never_boots(tmp_path):
    plane = ControlPlane(tmp_path, FakeRuntime(ready_after=60))
    try:
        async with plane.http(plane.key_for("local")) as client:
            await new_machine(client, "slow")
            response = await client.post("/v1/machines/slow/wait", params={"timeout": 0.2})
            assert response.status_code == 504
            assert error_of(response)["code"] == "timeout"
    finally:
        await plane.close()


async def test_wait_on_a_failed_boot_is_409_with_the_reason(tmp_path):
    from boxd.errors import Timeout

    plane = ControlPlane(tmp_path, FakeRuntime(fail_ready=Timeout("agent never answered")))
    try:
        async with plane.http(plane.key_for("local")) as client:
            await new_machine(client, "dud")
            response = await client.post("/v1/machines/dud/wait")
            assert response.status_code == 409
            assert "agent never answered" in error_of(response)["message"]
            assert (await client.get("/v1/machines/dud")).json()["state"] == "failed"
    finally:
        await plane.close()


async def test_exec_waits_for_a_starting_machine(tmp_path):
    plane = ControlPlane(tmp_path, FakeRuntime(ready_after=0.3))
    try:
        async with plane.http(plane.key_for("local")) as client:
            await new_machine(client, "boot")
            response = await client.post("/v1/machines/boot/exec", json={"cmd": "echo hi"})
            assert response.status_code == 200
            assert base64.b64decode(response.json()["stdout_b64"]) == b"hi\n"
    finally:
        await plane.close()


async def test_a_machine_whose_process_died_shows_failed(plane, alice):
    machine = await new_machine(alice)
    await alice.post("/v1/machines/rl-base/wait")
    plane.runtime.host.kill(machine["id"])
    got = (await alice.get("/v1/machines/rl-base")).json()
    assert got["state"] == "failed" and "exited" in got["reason"]


# -- exec --------------------------------------------------------------------------------


async def test_exec_shell_and_argv(alice):
    await new_machine(alice)
    shell = (await alice.post("/v1/machines/rl-base/exec", json={"cmd": "echo out; echo err >&2; exit 3"})).json()
    assert base64.b64decode(shell["stdout_b64"]) == b"out\n"
    assert base64.b64decode(shell["stderr_b64"]) == b"err\n"
    assert shell["exit_code"] == 3 and shell["timed_out"] is False and shell["duration_s"] >= 0
    argv = (await alice.post("/v1/machines/rl-base/exec", json={"argv": ["printf", "%s|", "a b", "$HOME"]})).json()
    assert base64.b64decode(argv["stdout_b64"]) == b"a b|$HOME|"


async def test_exec_env_cwd_stdin_timeout(alice, tmp_path):
    await new_machine(alice)
    body = {
        "cmd": "echo $GREETING; pwd; cat",
        "env": {"GREETING": "hello"},
        "cwd": str(tmp_path),
        "stdin_b64": base64.b64encode(b"piped").decode(),
    }
    result = (await alice.post("/v1/machines/rl-base/exec", json=body)).json()
    assert base64.b64decode(result["stdout_b64"]) == f"hello\n{tmp_path}\npiped".encode()
    slow = (await alice.post("/v1/machines/rl-base/exec", json={"cmd": "sleep 5", "timeout": 0.2})).json()
    assert slow["timed_out"] is True and slow["exit_code"] == 128 + 9


@pytest.mark.parametrize(
    "body, field",
    [
        ({}, "argv"),
        ({"cmd": "a", "argv": ["b"]}, "argv"),
        ({"cmd": ""}, "cmd"),
        ({"argv": []}, "argv"),
        ({"cmd": "a", "timeout": -1}, "timeout"),
        ({"cmd": "a", "stdin_b64": "not base64!"}, "stdin_b64"),
        ({"cmd": "a", "env": {"A": 1}}, "env.A"),
    ],
)
async def test_bad_exec_bodies_are_422(alice, body, field):
    await new_machine(alice)
    response = await alice.post("/v1/machines/rl-base/exec", json=body)
    assert response.status_code == 422
    assert error_of(response)["field"] == field


async def test_exec_stream_is_ndjson_events(alice):
    await new_machine(alice)
    response = await alice.post("/v1/machines/rl-base/exec/stream", json={"cmd": "echo one; echo two >&2; exit 4"})
    assert response.status_code == 200
    assert response.headers["content-type"].startswith("application/x-ndjson")
    events = [json.loads(line) for line in response.text.splitlines()]
    assert events[0]["type"] == "started" and events[0]["pid"] > 0
    assert events[-1] == {"type": "exit", "exit_code": 4}
    output = {kind: b"".join(base64.b64decode(e["data_b64"]) for e in events if e["type"] == kind)
              for kind in ("stdout", "stderr")}
    assert output == {"stdout": b"one\n", "stderr": b"two\n"}


# -- files -------------------------------------------------------------------------------


async def test_upload_and_download(plane, alice):
    machine = await new_machine(alice)
    payload = bytes(range(256)) * 1000
    written = await alice.put("/v1/machines/rl-base/files", params={"path": "/home/boxd/data.bin", "mode": 420},
                              content=payload)
    assert written.status_code == 200
    assert written.json() == {"path": "/home/boxd/data.bin", "size": len(payload)}
    assert plane.runtime.host.vms[machine["id"]].files["/home/boxd/data.bin"] == payload
    downloaded = await alice.get("/v1/machines/rl-base/files", params={"path": "/home/boxd/data.bin"})
    assert downloaded.status_code == 200 and downloaded.content == payload
    assert downloaded.headers["content-type"] == "application/octet-stream"
    missing = await alice.get("/v1/machines/rl-base/files", params={"path": "/nope"})
    assert missing.status_code == 404


async def test_an_empty_file_round_trips(alice):
    await new_machine(alice)
    await alice.put("/v1/machines/rl-base/files", params={"path": "/empty"}, content=b"")
    response = await alice.get("/v1/machines/rl-base/files", params={"path": "/empty"})
    assert response.status_code == 200 and response.content == b""


async def test_oversized_upload_is_413_naming_the_field(tmp_path):
    plane = ControlPlane(tmp_path, limits=Limits(max_upload_bytes=1024))
    try:
        async with plane.http(plane.key_for("local")) as client:
            machine = await new_machine(client)

            async def streamed():  # no Content-Length: the daemon counts as it goes
                for _ in range(4):
                    yield b"x" * 512

            for content in (b"x" * 1025, streamed()):
                response = await client.put("/v1/machines/rl-base/files", params={"path": "/big"}, content=content)
                assert response.status_code == 413
                error = error_of(response)
                assert error["code"] == "too_large" and error["field"] == "body"
            assert plane.runtime.host.vms[machine["id"]].files == {}
            ok = await client.put("/v1/machines/rl-base/files", params={"path": "/fits"}, content=b"x" * 1024)
            assert ok.status_code == 200
    finally:
        await plane.close()


@pytest.mark.parametrize("path", ["relative/path", "", "/with\0nul", "/" + "a" * 5000])
async def test_bad_paths_are_422(plane, alice, path):
    machine = await new_machine(alice)
    put = await alice.put("/v1/machines/rl-base/files", params={"path": path}, content=b"x")
    get = await alice.get("/v1/machines/rl-base/files", params={"path": path})
    for response in (put, get):
        assert response.status_code == 422
        assert error_of(response)["field"] == "path"
    assert plane.runtime.host.vms[machine["id"]].files == {}


async def test_bad_mode_is_422(alice):
    await new_machine(alice)
    response = await alice.put("/v1/machines/rl-base/files", params={"path": "/x", "mode": 99999}, content=b"x")
    assert response.status_code == 422 and error_of(response)["field"] == "mode"


# -- restart -----------------------------------------------------------------------------


async def test_restart_readopts_and_marks_dead_machines_failed(plane, alice):
    alive = await new_machine(alice, "alive")
    dead = await new_machine(alice, "dead")
    await alice.post("/v1/machines/alive/wait")
    await alice.post("/v1/machines/dead/wait")
    await new_machine(alice, "gone")
    await alice.delete("/v1/machines/gone")
    key = plane.key_for("zed")
    plane.runtime.host.kill(dead["id"])

    restarted = await plane.restarted()
    try:
        assert restarted.runtime.adopted == {alive["id"], dead["id"]}
        assert restarted.runtime.collected == 1  # what the dead daemon left half-done
        async with restarted.http(key) as zed:
            assert (await zed.get("/v1/machines")).status_code == 200  # keys survive
        async with restarted.http(restarted.key_for("alice")) as client:
            states = {m["name"]: m["state"] for m in (await client.get("/v1/machines")).json()}
            assert states == {"alive": "running", "dead": "failed"}
            result = (await client.post("/v1/machines/alive/exec", json={"cmd": "echo still here"})).json()
            assert base64.b64decode(result["stdout_b64"]) == b"still here\n"
    finally:
        await restarted.close()


async def test_a_machine_starting_at_restart_becomes_ready_after_it(tmp_path):
    plane = ControlPlane(tmp_path, FakeRuntime(ready_after=60))
    async with plane.http(plane.key_for("local")) as client:
        await new_machine(client, "booting")
    restarted = await plane.restarted(FakeRuntime(plane.runtime.host))
    try:
        async with restarted.http(restarted.key_for("local")) as client:
            response = await client.post("/v1/machines/booting/wait", params={"timeout": 5})
            assert response.json()["state"] == "running"
    finally:
        await restarted.close()
