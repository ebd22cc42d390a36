"""Checkpoints and snapshots through the HTTP API and the SDK, over the real app and store.

The FakeRuntime keeps a machine's files in a dict: a checkpoint copies them, a restore
puts the copy back, and a snapshot keeps a copy named by its content on the fake host.
So every test can tell which instant a machine is at by the files it holds.
"""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest
from fakes import ControlPlane, FakeRuntime, daemon_thread, short_home

from boxd import AsyncBoxd, Boxd
from boxd.errors import Conflict, HostError, NotFound, Timeout
from boxd.models import Checkpoint, Machine, MachineState, Snapshot, SnapshotState
from boxd.sdk import async_client, sync_client

pytestmark = pytest.mark.anyio

home = pytest.fixture(short_home)


def plane_with(tmp_path, **runtime_options) -> ControlPlane:
    """A control plane whose FakeRuntime is told how to behave (slow or failing saves)."""
    return ControlPlane(tmp_path, FakeRuntime(**runtime_options))


def error_of(response) -> dict:
    return response.json()["error"]


async def ready_machine(client, name: str = "rl-base", **fields) -> dict:
    created = await client.post("/v1/machines", json={"name": name, **fields})
    assert created.status_code == 201, created.text
    ready = await client.post(f"/v1/machines/{name}/wait", params={"timeout": 5})
    assert ready.json()["state"] == "running", ready.text
    return ready.json()


async def write(client, machine: str, path: str, data: bytes) -> None:
    response = await client.put(f"/v1/machines/{machine}/files", params={"path": path}, content=data)
    assert response.status_code == 200, response.text


async def read(client, machine: str, path: str) -> bytes | None:
    response = await client.get(f"/v1/machines/{machine}/files", params={"path": path})
    return None if response.status_code == 404 else response.content


async def finished(client, ref: str) -> dict:
    """The snapshot version once it is no longer saving."""
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        snapshot = (await client.get(f"/v1/snapshots/{ref}")).json()
        if snapshot["state"] != "saving":
            return snapshot
        await asyncio.sleep(0.01)
    raise AssertionError(f"snapshot {ref} still saving")


async def save_snapshot(client, machine: str, name: str) -> dict:
    response = await client.post("/v1/snapshots", json={"machine": machine, "name": name})
    assert response.status_code == 201, response.text
    return await finished(client, response.json()["ref"])


# -- checkpoints -------------------------------------------------------------------------


async def test_checkpoint_save_list_restore_delete(plane, alice):
    machine = await ready_machine(alice)
    await write(alice, "rl-base", "/state", b"warm")
    saved = await alice.post("/v1/machines/rl-base/checkpoints", json={"name": "warm"})
    assert saved.status_code == 201, saved.text
    checkpoint = saved.json()
    assert (checkpoint["name"], checkpoint["machine"], checkpoint["pause_ms"]) == ("warm", machine["id"], 1.0)

    await write(alice, "rl-base", "/state", b"played")
    await write(alice, "rl-base", "/later", b"x")
    listed = (await alice.get("/v1/machines/rl-base/checkpoints")).json()
    assert [c["name"] for c in listed] == ["warm"]

    for _ in range(2):  # a checkpoint can be restored again and again
        restored = await alice.post("/v1/machines/rl-base/checkpoints/warm/restore")
        assert restored.status_code == 200, restored.text
        assert (restored.json()["id"], restored.json()["state"]) == (machine["id"], "running")
        assert await read(alice, "rl-base", "/state") == b"warm"
        assert await read(alice, "rl-base", "/later") is None
        await write(alice, "rl-base", "/state", b"played again")

    deleted = await alice.delete("/v1/machines/rl-base/checkpoints/warm")
    assert deleted.status_code == 204
    assert (await alice.get("/v1/machines/rl-base/checkpoints")).json() == []
    assert plane.runtime.host.vms[machine["id"]].checkpoints == {}
    gone = await alice.post("/v1/machines/rl-base/checkpoints/warm/restore")
    assert gone.status_code == 404
    assert await read(alice, "rl-base", "/state") == b"played again"


async def test_a_duplicate_checkpoint_name_is_409_and_changes_nothing(plane, alice):
    machine = await ready_machine(alice)
    await write(alice, "rl-base", "/state", b"first")
    await alice.post("/v1/machines/rl-base/checkpoints", json={"name": "warm"})
    await write(alice, "rl-base", "/state", b"second")
    again = await alice.post("/v1/machines/rl-base/checkpoints", json={"name": "warm"})
    assert again.status_code == 409
    assert error_of(again)["field"] == "name"
    assert len((await alice.get("/v1/machines/rl-base/checkpoints")).json()) == 1
    assert len(plane.runtime.host.vms[machine["id"]].checkpoints) == 1
    # The name still means the first instant.
    await alice.post("/v1/machines/rl-base/checkpoints/warm/restore")
    assert await read(alice, "rl-base", "/state") == b"first"


@pytest.mark.parametrize("name", ["", "UPPER", "a" * 64, "-lead", "has/slash", "sp ace", 7])
async def test_bad_checkpoint_and_snapshot_names_are_422_naming_the_field(plane, alice, name):
    machine = await ready_machine(alice)
    for path, body in [
        ("/v1/machines/rl-base/checkpoints", {"name": name}),
        ("/v1/snapshots", {"machine": "rl-base", "name": name}),
    ]:
        response = await alice.post(path, json=body)
        assert response.status_code == 422, path
        assert error_of(response)["field"] == "name"
    assert (await alice.get("/v1/machines/rl-base/checkpoints")).json() == []
    assert (await alice.get("/v1/snapshots")).json() == []
    assert plane.runtime.host.vms[machine["id"]].checkpoints == {}


async def test_unknown_checkpoints_and_machines_are_404_and_change_nothing(plane, alice):
    machine = await ready_machine(alice)
    await write(alice, "rl-base", "/state", b"now")
    for method, path, body in [
        ("POST", "/v1/machines/rl-base/checkpoints/nope/restore", None),
        ("DELETE", "/v1/machines/rl-base/checkpoints/nope", None),
        ("POST", "/v1/machines/missing/checkpoints", {"name": "warm"}),
        ("GET", "/v1/machines/missing/checkpoints", None),
    ]:
        response = await alice.request(method, path, json=body)
        assert response.status_code == 404, path
        assert error_of(response)["code"] == "not_found"
    unknown = await alice.post("/v1/machines/rl-base/checkpoints/nope/restore")
    assert error_of(unknown)["field"] == "checkpoint"
    assert (await alice.get("/v1/machines/rl-base")).json()["state"] == "running"
    assert await read(alice, "rl-base", "/state") == b"now"
    assert plane.runtime.host.vms[machine["id"]].checkpoints == {}


async def test_a_checkpoint_goes_with_its_machine(plane, alice):
    old = await ready_machine(alice)
    await alice.post("/v1/machines/rl-base/checkpoints", json={"name": "warm"})
    assert plane.store.list_checkpoints(old["id"]) != []
    await alice.delete("/v1/machines/rl-base")
    assert plane.store.list_checkpoints(old["id"]) == []
    new = await ready_machine(alice)  # the same name, another machine
    assert new["id"] != old["id"]
    assert (await alice.get("/v1/machines/rl-base/checkpoints")).json() == []
    assert (await alice.post("/v1/machines/rl-base/checkpoints/warm/restore")).status_code == 404


async def test_another_account_cannot_see_or_use_checkpoints(plane, alice):
    machine = await ready_machine(alice, "secret")
    await write(alice, "secret", "/state", b"saved")
    await alice.post("/v1/machines/secret/checkpoints", json={"name": "warm"})
    await write(alice, "secret", "/state", b"current")
    async with plane.http(plane.key_for("bob")) as bob:
        for ref in ("secret", machine["id"]):
            for method, path, body in [
                ("GET", f"/v1/machines/{ref}/checkpoints", None),
                ("POST", f"/v1/machines/{ref}/checkpoints", {"name": "mine"}),
                ("POST", f"/v1/machines/{ref}/checkpoints/warm/restore", None),
                ("DELETE", f"/v1/machines/{ref}/checkpoints/warm", None),
            ]:
                response = await bob.request(method, path, json=body)
                assert response.status_code == 404, (method, path)
    assert [c["name"] for c in (await alice.get("/v1/machines/secret/checkpoints")).json()] == ["warm"]
    assert len(plane.runtime.host.vms[machine["id"]].checkpoints) == 1
    assert await read(alice, "secret", "/state") == b"current"


async def test_a_failed_machine_is_not_restored_past_the_quota(plane):
    async with plane.http(plane.key_for("carol", max_machines=1)) as carol:
        first = await ready_machine(carol, "first")
        await carol.post("/v1/machines/first/checkpoints", json={"name": "warm"})
        plane.runtime.host.kill(first["id"])
        assert (await carol.get("/v1/machines/first")).json()["state"] == "failed"
        await ready_machine(carol, "second")  # the failed one no longer counts

        refused = await carol.post("/v1/machines/first/checkpoints/warm/restore")
        assert refused.status_code == 409 and error_of(refused)["field"] == "machine"
        states = {m["name"]: m["state"] for m in (await carol.get("/v1/machines")).json()}
        assert states == {"first": "failed", "second": "running"}


# -- snapshots ---------------------------------------------------------------------------


async def test_a_snapshot_is_saving_then_ready_with_its_digest(tmp_path):
    plane = plane_with(tmp_path, snapshot_s=1.0)
    try:
        async with plane.http(plane.key_for("alice")) as alice:
            machine = await ready_machine(alice)
            await write(alice, "rl-base", "/state", b"12345678")
            response = await alice.post("/v1/snapshots", json={"machine": "rl-base", "name": "base"})
            assert response.status_code == 201, response.text
            saving = response.json()
            assert (saving["ref"], saving["version"], saving["state"]) == ("base@1", 1, "saving")
            assert saving["digest"] is None and saving["machine"] == machine["id"] and saving["pause_ms"] == 1.0

            await asyncio.sleep(0.1)
            halfway = (await alice.get("/v1/snapshots/base@1")).json()
            assert (halfway["state"], halfway["progress"]) == ("saving", 0.5)
            # NAME means the newest ready version: there is none yet.
            assert (await alice.get("/v1/snapshots/base")).status_code == 404
            assert (await alice.delete("/v1/snapshots/base@1")).status_code == 409
            early = await alice.post("/v1/machines", json={"name": "early", "from_snapshot": "base@1"})
            assert early.status_code == 409 and error_of(early)["field"] == "from_snapshot"

            ready = await finished(alice, "base@1")
            assert ready["state"] == "ready" and ready["progress"] is None
            assert ready["size_bytes"] == 8
            assert ready["digest"] in plane.runtime.host.snapshots
            assert plane.runtime.host.snapshots[ready["digest"]].files == {"/state": b"12345678"}
            for ref in ("base", ready["digest"], ready["digest"][:12]):
                assert (await alice.get(f"/v1/snapshots/{ref}")).json()["ref"] == "base@1", ref
            # Its checkpoint was only a means: dropped, and never a user's.
            assert plane.runtime.host.vms[machine["id"]].checkpoints == {}
            assert (await alice.get("/v1/machines/rl-base/checkpoints")).json() == []
            assert [m["name"] for m in (await alice.get("/v1/machines")).json()] == ["rl-base"]
    finally:
        await plane.close()


async def test_saving_a_name_again_adds_a_version(alice):
    await ready_machine(alice)
    await write(alice, "rl-base", "/state", b"one")
    first = await save_snapshot(alice, "rl-base", "base")
    await write(alice, "rl-base", "/state", b"two")
    second = await save_snapshot(alice, "rl-base", "base")
    assert (first["ref"], second["ref"]) == ("base@1", "base@2")
    assert first["digest"] != second["digest"]
    listed = (await alice.get("/v1/snapshots")).json()
    assert [(s["ref"], s["state"]) for s in listed] == [("base@1", "ready"), ("base@2", "ready")]
    assert (await alice.get("/v1/snapshots/base")).json()["digest"] == second["digest"]
    assert (await alice.get("/v1/snapshots/base@1")).json()["digest"] == first["digest"]

    for name, ref, expected in [("from-newest", "base", b"two"), ("from-first", "base@1", b"one")]:
        await ready_machine(alice, name, from_snapshot=ref)
        assert await read(alice, name, "/state") == expected


async def test_a_machine_from_a_snapshot_outlives_its_source_and_takes_its_size(plane, alice):
    await ready_machine(alice, "source", memory_mib=256, disk_gib=2, isolated=True)
    await write(alice, "source", "/home/boxd/env", b"warmed up")
    snapshot = await save_snapshot(alice, "source", "base")
    assert (snapshot["memory_mib"], snapshot["disk_gib"], snapshot["isolated"]) == (256, 2, True)
    await alice.delete("/v1/machines/source")

    # The size asked for is the default; the snapshot's wins, its RAM being of one size.
    clone = await ready_machine(alice, "clone", from_snapshot="base")
    assert (clone["memory_mib"], clone["disk_gib"], clone["isolated"]) == (256, 2, True)
    spec = plane.runtime.host.vms[clone["id"]].spec
    assert (spec.memory_mib, spec.disk_gib, spec.isolated) == (256, 2, True)
    assert await read(alice, "clone", "/home/boxd/env") == b"warmed up"
    # A machine of its own: changing it leaves the snapshot as it was.
    await write(alice, "clone", "/home/boxd/env", b"changed")
    await ready_machine(alice, "again", from_snapshot=snapshot["digest"])
    assert await read(alice, "again", "/home/boxd/env") == b"warmed up"


@pytest.mark.parametrize("ref", ["nope", "nope@1", "base@9", "base@x", "0" * 64])
async def test_from_an_unknown_snapshot_is_404_and_leaves_no_machine(plane, ref):
    async with plane.http(plane.key_for("carol", max_machines=2)) as carol:
        await ready_machine(carol, "source")
        await save_snapshot(carol, "source", "base")
        vms = set(plane.runtime.host.vms)
        response = await carol.post("/v1/machines", json={"name": "clone", "from_snapshot": ref})
        assert response.status_code == 404
        assert error_of(response)["field"] in {"from_snapshot", "snapshot"}
        assert [m["name"] for m in (await carol.get("/v1/machines")).json()] == ["source"]
        assert set(plane.runtime.host.vms) == vms
        # Nothing was left to count against the quota: the last slot is still free.
        assert (await carol.post("/v1/machines", json={"name": "clone"})).status_code == 201


async def test_another_account_cannot_see_or_use_snapshots(plane, alice):
    await ready_machine(alice, "source")
    snapshot = await save_snapshot(alice, "source", "base")
    async with plane.http(plane.key_for("bob")) as bob:
        assert (await bob.get("/v1/snapshots")).json() == []
        for ref in ("base", "base@1", snapshot["digest"], snapshot["digest"][:12]):
            assert (await bob.get(f"/v1/snapshots/{ref}")).status_code == 404, ref
            assert (await bob.delete(f"/v1/snapshots/{ref}")).status_code == 404, ref
            stolen = await bob.post("/v1/machines", json={"name": "stolen", "from_snapshot": ref})
            assert stolen.status_code == 404, ref
        # Nor save one from alice's machine.
        assert (await bob.post("/v1/snapshots", json={"machine": "source", "name": "x"})).status_code == 404
        assert (await bob.get("/v1/machines")).json() == []
    assert [s["ref"] for s in (await alice.get("/v1/snapshots")).json()] == ["base@1"]
    assert snapshot["digest"] in plane.runtime.host.snapshots


async def test_a_snapshot_that_fails_is_failed_with_the_reason(tmp_path):
    plane = plane_with(tmp_path, fail_snapshot=HostError("no space left on device"))
    try:
        async with plane.http(plane.key_for("alice")) as alice:
            machine = await ready_machine(alice)
            failed = await save_snapshot(alice, "rl-base", "base")
            assert failed["state"] == "failed" and "no space left" in failed["reason"]
            assert failed["digest"] is None and failed["size_bytes"] is None
            assert plane.runtime.host.snapshots == {}
            assert plane.runtime.host.vms[machine["id"]].checkpoints == {}
            # The machine it came from is unharmed.
            assert (await alice.get("/v1/machines/rl-base")).json()["state"] == "running"

            from_failed = await alice.post("/v1/machines", json={"name": "clone", "from_snapshot": "base@1"})
            assert from_failed.status_code == 409 and error_of(from_failed)["field"] == "from_snapshot"
            # NAME means its newest ready version, and a failed one is not.
            assert (await alice.post("/v1/machines", json={"name": "clone", "from_snapshot": "base"})).status_code == 404
            assert [m["name"] for m in (await alice.get("/v1/machines")).json()] == ["rl-base"]
            # A failed version can be deleted; the next save takes the next number.
            assert [s["ref"] for s in (await alice.delete("/v1/snapshots/base")).json()] == ["base@1"]
            plane.runtime.fail_snapshot = None
            assert (await save_snapshot(alice, "rl-base", "base"))["ref"] == "base@2"
    finally:
        await plane.close()


async def test_deleting_one_version_keeps_the_others(plane, alice):
    await ready_machine(alice)
    await write(alice, "rl-base", "/state", b"one")
    first = await save_snapshot(alice, "rl-base", "base")
    await write(alice, "rl-base", "/state", b"two")
    second = await save_snapshot(alice, "rl-base", "base")

    deleted = await alice.delete("/v1/snapshots/base@1")
    assert deleted.status_code == 200 and [s["ref"] for s in deleted.json()] == ["base@1"]
    assert [s["ref"] for s in (await alice.get("/v1/snapshots")).json()] == ["base@2"]
    assert (await alice.get("/v1/snapshots/base@1")).status_code == 404
    assert set(plane.runtime.host.snapshots) == {second["digest"]}
    # A number once given is never given again.
    await write(alice, "rl-base", "/state", b"three")
    third = await save_snapshot(alice, "rl-base", "base")
    assert third["ref"] == "base@3" and first["digest"] not in plane.runtime.host.snapshots

    everything = await alice.delete("/v1/snapshots/base")
    assert [s["ref"] for s in everything.json()] == ["base@2", "base@3"]
    assert (await alice.get("/v1/snapshots")).json() == []
    assert plane.runtime.host.snapshots == {}


async def test_a_digest_stays_on_the_host_while_a_version_holds_it(plane, alice):
    await ready_machine(alice)
    await write(alice, "rl-base", "/state", b"same")
    first = await save_snapshot(alice, "rl-base", "base")
    second = await save_snapshot(alice, "rl-base", "base")
    assert first["digest"] == second["digest"]  # the same content has the same name
    await alice.delete("/v1/snapshots/base@1")
    assert first["digest"] in plane.runtime.host.snapshots
    await ready_machine(alice, "clone", from_snapshot="base@2")
    assert await read(alice, "clone", "/state") == b"same"
    await alice.delete("/v1/snapshots/base@2")
    assert plane.runtime.host.snapshots == {}


async def test_snapshots_survive_a_restart_and_one_cut_short_is_failed(tmp_path):
    plane = plane_with(tmp_path)
    async with plane.http(plane.key_for("alice")) as alice:
        machine = await ready_machine(alice)
        await write(alice, "rl-base", "/state", b"kept")
        kept = await save_snapshot(alice, "rl-base", "kept")
        plane.runtime.snapshot_s = 60  # the next one is still being written at the restart
        cut = await alice.post("/v1/snapshots", json={"machine": "rl-base", "name": "cut"})
        assert cut.json()["state"] == "saving"

    restarted = await plane.restarted()
    try:
        async with restarted.http(restarted.key_for("alice")) as alice:
            states = {s["ref"]: s["state"] for s in (await alice.get("/v1/snapshots")).json()}
            assert states == {"kept@1": "ready", "cut@1": "failed"}
            assert "daemon stopped" in (await alice.get("/v1/snapshots/cut@1")).json()["reason"]
            assert (await alice.get("/v1/snapshots/kept")).json()["digest"] == kept["digest"]
            assert restarted.runtime.host.vms[machine["id"]].checkpoints == {}
            await ready_machine(alice, "after", from_snapshot="kept")
            assert await read(alice, "after", "/state") == b"kept"
    finally:
        await restarted.close()


async def test_the_quota_holds_for_machines_from_a_snapshot(plane):
    async with plane.http(plane.key_for("dave", max_machines=1)) as dave:
        await ready_machine(dave, "source")
        await save_snapshot(dave, "source", "base")
        over = await dave.post("/v1/machines", json={"name": "clone", "from_snapshot": "base"})
        assert over.status_code == 429
        assert error_of(over)["details"] == {"limit": 1, "running": 1}
        assert [m["name"] for m in (await dave.get("/v1/machines")).json()] == ["source"]
        assert len(plane.runtime.host.vms) == 1
        await dave.delete("/v1/machines/source")
        assert (await dave.post("/v1/machines", json={"name": "clone", "from_snapshot": "base"})).status_code == 201


# -- the SDK -----------------------------------------------------------------------------


def async_sdk(plane: ControlPlane, key: str) -> AsyncBoxd:
    return AsyncBoxd(api_key=key, base_url=plane.TCP_URL, transport=plane.transport())


async def test_sdk_checkpoints(plane):
    async with async_sdk(plane, plane.key_for("alice")) as boxd:
        machine = await boxd.machines.new("rl-base")
        await boxd.machines.files.upload(machine, "/state", "warm")
        saved = await boxd.machines.checkpoints.save(machine, "warm")
        assert isinstance(saved, Checkpoint) and saved.machine == machine.id
        await boxd.machines.files.upload(machine, "/state", "played")
        assert [c.name for c in await boxd.machines.checkpoints.list("rl-base")] == ["warm"]
        restored = await boxd.machines.checkpoints.restore("rl-base", "warm")
        assert isinstance(restored, Machine) and restored.state is MachineState.RUNNING
        assert await boxd.machines.files.download(machine, "/state") == b"warm"
        with pytest.raises(Conflict):
            await boxd.machines.checkpoints.save(machine, "warm")
        assert await boxd.machines.checkpoints.delete(machine, "warm") is None
        assert await boxd.machines.checkpoints.list(machine) == []
        with pytest.raises(NotFound) as missing:
            await boxd.machines.checkpoints.restore(machine, "warm")
        assert missing.value.field == "checkpoint"


async def test_sdk_snapshot_save_waits_reporting_progress(tmp_path):
    plane = plane_with(tmp_path, snapshot_s=0.8)
    try:
        async with async_sdk(plane, plane.key_for("alice")) as boxd:
            source = await boxd.machines.new("source", memory_mib=256)
            await boxd.machines.files.upload(source, "/state", "warm")
            seen: list[Snapshot] = []
            snapshot = await boxd.snapshots.save(source, "base", progress=seen.append)
            assert snapshot.state is SnapshotState.READY and snapshot.ref == "base@1"
            assert snapshot.digest in plane.runtime.host.snapshots
            assert seen[0].state is SnapshotState.SAVING and seen[-1] == snapshot
            assert 0.5 in {s.progress for s in seen}  # polled while it was half written
            assert (await boxd.snapshots.get("base")).digest == snapshot.digest
            assert [s.ref for s in await boxd.snapshots.list()] == ["base@1"]

            clone = await boxd.machines.new("clone", from_snapshot="base")
            assert clone.memory_mib == 256
            assert await boxd.machines.files.download(clone, "/state") == b"warm"

            started = await boxd.snapshots.save("source", "base", wait=False)
            assert started.state is SnapshotState.SAVING and started.ref == "base@2"
            with pytest.raises(Timeout, match="base@3"):
                await boxd.snapshots.save("source", "base", timeout=0.1)
            assert [s.ref for s in await boxd.snapshots.delete("base@1")] == ["base@1"]
            with pytest.raises(NotFound):
                await boxd.snapshots.get("base@1")
    finally:
        await plane.close()


async def test_sdk_snapshot_save_raises_when_saving_fails(tmp_path):
    plane = plane_with(tmp_path, fail_snapshot=HostError("no space left on device"))
    try:
        async with async_sdk(plane, plane.key_for("alice")) as boxd:
            await boxd.machines.new("source")
            with pytest.raises(Conflict, match="base@1 failed: no space left"):
                await boxd.snapshots.save("source", "base")
            assert (await boxd.snapshots.get("base@1")).state is SnapshotState.FAILED
    finally:
        await plane.close()


def test_the_new_sdk_classes_have_sync_faces_with_the_same_parameters():
    pairs = [
        (async_client.AsyncCheckpoints, sync_client.Checkpoints),
        (async_client.AsyncSnapshots, sync_client.Snapshots),
    ]
    for async_cls, sync_cls in pairs:
        for name, method in inspect.getmembers(async_cls, inspect.isfunction):
            if name.startswith("_"):
                continue
            mirror = getattr(sync_cls, name)
            assert inspect.signature(mirror).parameters == inspect.signature(method).parameters
            assert mirror.__doc__ == method.__doc__


def test_the_sync_face_of_checkpoints_and_snapshots(home, monkeypatch):
    monkeypatch.setenv("BOXD_HOME", str(home))
    monkeypatch.delenv("BOXD_URL", raising=False)
    monkeypatch.delenv("BOXD_API_KEY", raising=False)
    with daemon_thread(home, FakeRuntime(snapshot_s=0.8)), Boxd() as boxd:
        source = boxd.machines.new("source")
        boxd.machines.files.upload(source, "/state", "warm")
        boxd.machines.checkpoints.save(source, "warm")
        boxd.machines.files.upload(source, "/state", "played")
        assert [c.name for c in boxd.machines.checkpoints.list(source)] == ["warm"]
        assert boxd.machines.checkpoints.restore(source, "warm").id == source.id
        assert boxd.machines.files.download(source, "/state") == b"warm"
        boxd.machines.checkpoints.delete(source, "warm")
        assert boxd.machines.checkpoints.list(source) == []

        seen: list[float | None] = []
        snapshot = boxd.snapshots.save(source, "base", progress=lambda s: seen.append(s.progress))
        assert snapshot.state is SnapshotState.READY and 0.5 in seen
        assert boxd.snapshots.get(snapshot.digest).ref == "base@1"
        assert [s.ref for s in boxd.snapshots.list()] == ["base@1"]
        clone = boxd.machines.new("clone", from_snapshot="base@1")
        assert boxd.machines.files.download(clone, "/state") == b"warm"
        assert [s.ref for s in boxd.snapshots.delete("base")] == ["base@1"]
