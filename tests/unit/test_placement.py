"""Where the Ray runtime puts a machine (pure), and what the daemon does with machines
whose host died (the real app and store over a FakeRuntime)."""

from __future__ import annotations

import random

import pytest
from fakes import ControlPlane, FakeRuntime

from boxd.cluster.placement import RESERVE_MIB, HostLoad, candidates
from boxd.models import MachineCreate, MachineState


def load(host: str, available: int, committed: int = 0, total: int = 16384, machines: int = 0) -> HostLoad:
    return HostLoad(host=host, node_id=host, available_mib=available, committed_mib=committed,
                    total_mib=total, machines=machines)


def test_the_roomiest_host_of_the_sample_comes_first_then_the_others_with_room():
    loads = [load("a", 8000), load("b", 3000), load("full", 700)]
    order = candidates(loads, 512, best_of=3, rng=random.Random(1))
    assert [host.host for host in order] == ["a", "b"]  # "full" keeps its reserve


def test_room_counts_what_machines_committed_not_only_what_is_free_now():
    # 12 GiB free right now, but 14 GiB promised to guests on a 16 GiB host.
    crowded = load("crowded", available=12000, committed=14336)
    assert crowded.headroom_mib == 16384 - 14336 - RESERVE_MIB
    assert [h.host for h in candidates([crowded, load("calm", 4000)], 512, best_of=2)] == ["calm", "crowded"]
    assert candidates([crowded], 2048) == []


def test_a_sample_of_k_spreads_ties_and_never_picks_outside_the_sample():
    loads = [load(name, 8000) for name in "abcdef"]
    firsts = {candidates(loads, 512, best_of=2, rng=random.Random(seed))[0].host for seed in range(40)}
    assert len(firsts) > 3


class LosingRuntime(FakeRuntime):
    """A FakeRuntime whose hosts can die: ``gone`` machines are reported lost."""

    def __init__(self) -> None:
        super().__init__()
        self.gone: set[str] = set()

    async def lost(self) -> list[str]:
        return sorted(self.gone)


@pytest.mark.anyio
async def test_machines_of_a_dead_host_are_lost_on_record_and_free_their_quota(tmp_path):
    runtime = LosingRuntime()
    plane = ControlPlane(tmp_path, runtime)
    try:
        plane.key_for("carol", max_machines=2)
        first = await plane.machines.create("carol", MachineCreate(name="first"))
        second = await plane.machines.create("carol", MachineCreate(name="second"))
        runtime.gone.add(first.id)
        await plane.machines.mark_lost()
        lost = plane.store.find_machine("carol", first.id)
        assert lost.state is MachineState.LOST and "gone" in (lost.reason or "")
        assert plane.store.find_machine("carol", second.id).state is not MachineState.LOST
        # The lost one no longer counts: a new machine fits in the quota of 2.
        await plane.machines.create("carol", MachineCreate(name="third"))
        await plane.machines.delete("carol", first.id)  # and it can be cleared away
        assert [m.name for m in plane.store.list_machines("carol")] == ["second", "third"]
    finally:
        await plane.close()


@pytest.mark.anyio
async def test_a_fork_onto_a_host_that_is_not_there_is_refused_and_changes_nothing(plane, alice):
    assert (await alice.post("/v1/machines", json={"name": "source"})).status_code == 201
    answer = await alice.post("/v1/machines/source/fork", json={"name": "child", "host": "boxd-host-elsewhere"})
    assert answer.status_code == 404 and answer.json()["error"]["field"] == "host"
    assert [m["name"] for m in (await alice.get("/v1/machines")).json()] == ["source"]
