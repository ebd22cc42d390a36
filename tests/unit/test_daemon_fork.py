"""The fork route through the real app and store, with a FakeRuntime underneath."""

from __future__ import annotations

import pytest

pytestmark = pytest.mark.anyio


async def ready_machine(client, name: str) -> dict:
    created = await client.post("/v1/machines", json={"name": name, "memory_mib": 256, "vcpus": 1})
    assert created.status_code == 201, created.text
    return (await client.post(f"/v1/machines/{name}/wait")).json()

async def test_a_fork_is_a_new_machine_with_its_sources_size_and_parent(plane):
    async with plane.http(plane.key_for("alice")) as alice:
        source = await ready_machine(alice, "rl-base")
        forked = await alice.post("/v1/machines/rl-base/fork", json={"name": "rollout-1"})
        assert forked.status_code == 201, forked.text
        fork = forked.json()
        assert fork["parent"] == source["id"] and fork["memory_mib"] == 256 and fork["name"] == "rollout-1"
        ready = (await alice.post(f"/v1/machines/{fork['id']}/wait")).json()
        assert ready["state"] == "running"
        names = {m["name"] for m in (await alice.get("/v1/machines")).json()}
        assert names == {"rl-base", "rollout-1"}

async def test_fork_errors_name_the_problem_and_change_nothing(plane):
    async with plane.http(plane.key_for("bob", max_machines=2)) as bob:
        await ready_machine(bob, "base")
        bad_name = await bob.post("/v1/machines/base/fork", json={"name": "Not/A-Name"})
        assert bad_name.status_code == 422 and bad_name.json()["error"]["field"] == "name"
        duplicate = await bob.post("/v1/machines/base/fork", json={"name": "base"})
        assert duplicate.status_code == 409
        unknown = await bob.post("/v1/machines/nope/fork", json={"name": "f"})
        assert unknown.status_code == 404
        assert (await bob.post("/v1/machines/base/fork", json={"name": "f1"})).status_code == 201
        over = await bob.post("/v1/machines/base/fork", json={"name": "f2"})
        assert over.status_code == 429 and "at most 2" in over.json()["error"]["message"]
        assert len((await bob.get("/v1/machines")).json()) == 2

async def test_another_accounts_machine_cannot_be_forked(plane):
    async with plane.http(plane.key_for("carol")) as carol, plane.http(plane.key_for("dave")) as dave:
        await ready_machine(carol, "secret")
        attempt = await dave.post("/v1/machines/secret/fork", json={"name": "stolen"})
        assert attempt.status_code == 404
        assert (await dave.get("/v1/machines")).json() == []

async def test_a_fork_whose_source_goes_meanwhile_leaves_no_machine_behind(plane, monkeypatch):
    """The source passed the daemon's checks, then a delete won the race in the runtime."""
    from boxd.errors import NotFound

    async with plane.http(plane.key_for("erin")) as erin:
        await ready_machine(erin, "base")

        async def source_gone(source_id, new_ids, *, host=None):
            raise NotFound(f"machine {source_id}: deleted meanwhile")

        monkeypatch.setattr(plane.runtime, "fork", source_gone)
        refused = await erin.post("/v1/machines/base/fork", json={"name": "orphan"})
        assert refused.status_code == 404
        assert [m["name"] for m in (await erin.get("/v1/machines")).json()] == ["base"]
        # the name is free again
        monkeypatch.undo()
        assert (await erin.post("/v1/machines/base/fork", json={"name": "orphan"})).status_code == 201
