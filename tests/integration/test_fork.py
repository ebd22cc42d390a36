"""Forks of running machines: the seed's left-hand column, checked on real VMs."""

from __future__ import annotations

import asyncio
import time

import pytest

from guest import fork_ready, gather, sh

pytestmark = pytest.mark.vm

COUNTER = (
    "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done' "
    ">/dev/null 2>&1 & echo $!"
)


def test_a_fork_continues_the_same_processes_memory_and_files(machines, runtime):
    source = machines.new()
    pid = machines.run(sh(runtime, source, COUNTER))
    machines.run(sh(runtime, source, "echo before > /home/boxd/before; sleep 0.5"))
    at_fork = int(machines.run(sh(runtime, source, "cat /tmp/count")))

    fork = machines.track(f"{source}-f")
    machines.run(fork_ready(runtime, source, fork))
    machines.run(sh(runtime, source, "echo after > /home/boxd/after"))

    # same process, same PID, its counter going on from where it was
    assert machines.run(sh(runtime, fork, f"cat /proc/{pid}/cmdline | tr '\\0' ' '")).startswith("sh -c")
    machines.run(asyncio.sleep(0.5))
    assert int(machines.run(sh(runtime, fork, "cat /tmp/count"))) > at_fork
    assert machines.run(sh(runtime, fork, "cat /home/boxd/before")) == "before"
    assert machines.run(sh(runtime, fork, "ls /home/boxd/after 2>/dev/null || echo absent")) == "absent"
    # the fork's clock was set to now, not left at the capture's instant
    guest_now = float(machines.run(sh(runtime, fork, "date +%s.%N")))
    assert abs(guest_now - time.time()) < 2


def test_forks_diverge_and_never_share_files_or_random_numbers(machines, runtime):
    source = machines.new()
    a, b = machines.track(f"{source}-a"), machines.track(f"{source}-b")
    machines.run(gather(fork_ready(runtime, source, a), fork_ready(runtime, source, b)))

    machines.run(sh(runtime, a, "echo only-a > /home/boxd/mine"))
    assert machines.run(sh(runtime, b, "cat /home/boxd/mine 2>/dev/null || echo absent")) == "absent"
    assert machines.run(sh(runtime, source, "cat /home/boxd/mine 2>/dev/null || echo absent")) == "absent"
    uuids = {machines.run(sh(runtime, vm, "cat /proc/sys/kernel/random/uuid")) for vm in (a, b, source)}
    assert len(uuids) == 3
    urandom = {machines.run(sh(runtime, vm, "head -c 16 /dev/urandom | od -An -tx1")) for vm in (a, b)}
    assert len(urandom) == 2


def test_eight_concurrent_forks_become_ready_and_outlive_their_source(machines, runtime):
    source = machines.new()
    machines.run(sh(runtime, source, "echo warm > /home/boxd/state"))
    forks = [machines.track(f"{source}-{n}") for n in range(8)]
    machines.run(gather(*(fork_ready(runtime, source, fork) for fork in forks)), timeout=300)

    machines.run(runtime.delete(source))
    states = machines.run(gather(*(sh(runtime, fork, "cat /home/boxd/state") for fork in forks)))
    assert states == ["warm"] * 8


def test_a_fork_of_a_fork(machines, runtime):
    source = machines.new()
    pid = machines.run(sh(runtime, source, COUNTER))
    child = machines.track(f"{source}-c")
    machines.run(fork_ready(runtime, source, child))
    machines.run(sh(runtime, child, "echo from-child > /home/boxd/child"))
    grandchild = machines.track(f"{source}-g")
    machines.run(fork_ready(runtime, child, grandchild))

    assert machines.run(sh(runtime, grandchild, "cat /home/boxd/child")) == "from-child"
    assert machines.run(sh(runtime, grandchild, f"test -d /proc/{pid} && echo alive")) == "alive"
    machines.run(runtime.delete(child))
    assert machines.run(sh(runtime, grandchild, "cat /home/boxd/child")) == "from-child"


async def chain_at_most(runtime, vm_id: str, layers: int, timeout: float = 60) -> None:
    """The chain is shortened in the background, right after the capture that grew it."""
    deadline = time.monotonic() + timeout
    while len(runtime._machines[vm_id].disk_frozen) > layers:
        assert time.monotonic() < deadline, runtime._machines[vm_id].disk_frozen
        await asyncio.sleep(0.1)


def test_repeated_forks_keep_the_source_disk_chain_short(machines, runtime):
    from boxd.runtime.local import MAX_FROZEN_LAYERS

    source = machines.new()
    forks = []
    for round_ in range(MAX_FROZEN_LAYERS + 2):
        machines.run(sh(runtime, source, f"echo {round_} > /home/boxd/round-{round_}"))
        forks.append(machines.track(f"{source}-{round_}"))
        machines.run(fork_ready(runtime, source, forks[-1]))
        machines.run(chain_at_most(runtime, source, MAX_FROZEN_LAYERS))
    # everything written before each fork is still there, in the source and in the forks
    assert machines.run(sh(runtime, source, "cat /home/boxd/round-*")).split() == [
        str(n) for n in range(MAX_FROZEN_LAYERS + 2)
    ]
    assert machines.run(sh(runtime, forks[0], "cat /home/boxd/round-0")) == "0"
    assert machines.run(sh(runtime, forks[-1], "ls /home/boxd | grep -c round")) == str(MAX_FROZEN_LAYERS + 2)


CHECKER = r"""
import os
pages = 4096  # 16 MiB that the process keeps rewriting, and checks against a second copy
memory, expected, i, checks = bytearray(pages * 4096), [0] * pages, 0, 0
while True:
    i += 1
    page = (i * 7919) % pages
    memory[page * 4096 : page * 4096 + 8] = i.to_bytes(8, "little")
    expected[page] = i
    if i % 4000 == 0:
        good = all(int.from_bytes(memory[p * 4096 : p * 4096 + 8], "little") == expected[p] for p in range(pages))
        checks += 1
        with open("/tmp/check.part", "w") as status:
            status.write(f"{checks} {'ok' if good else 'CORRUPT'}")
        os.replace("/tmp/check.part", "/tmp/check")
"""


async def checks_after(runtime, vm_id: str, after: int) -> str:
    """The checker's verdict once it has checked again since ``after``."""
    while True:
        count, verdict = (await sh(runtime, vm_id, "cat /tmp/check 2>/dev/null || echo 0 none")).split()
        if int(count) > after:
            return verdict
        await asyncio.sleep(0.5)


def test_memory_being_written_during_the_capture_arrives_consistent(machines, runtime):
    source = machines.new()
    async def one_chunk():
        yield CHECKER.encode()

    machines.run(runtime.write_file(source, "/home/boxd/checker.py", one_chunk()))
    machines.run(sh(runtime, source, "nohup python3 /home/boxd/checker.py >/dev/null 2>&1 &"))
    machines.run(checks_after(runtime, source, 0), timeout=120)
    forks = []
    for round_ in range(3):
        count = int(machines.run(sh(runtime, source, "cat /tmp/check")).split()[0])
        forks.append(machines.track(f"{source}-{round_}"))
        machines.run(fork_ready(runtime, source, forks[-1]))
        assert machines.run(checks_after(runtime, forks[-1], count), timeout=120) == "ok"
    assert machines.run(checks_after(runtime, source, count), timeout=120) == "ok"


def test_a_fork_of_an_isolated_machine_is_isolated_too(machines, runtime):
    source = machines.new(isolated=True)
    machines.run(sh(runtime, source, "echo inside > /home/boxd/note"))
    fork = machines.track(f"{source}-f")
    machines.run(fork_ready(runtime, source, fork))
    assert machines.run(sh(runtime, fork, "cat /home/boxd/note")) == "inside"
    assert runtime._machines[fork].spec.isolated
    assert machines.run(sh(runtime, fork, "getent hosts pypi.org || echo no-dns")) == "no-dns"
