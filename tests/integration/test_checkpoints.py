"""Checkpoints rewind a machine in place; snapshots outlive it. Real VMs, through the runtime."""

from __future__ import annotations

import pytest

from boxd.errors import NotFound, SnapshotUnusable
from boxd.runtime.interface import VMSpec
from boxd.runtime.qemu import process_alive

from guest import fork_ready, gather, sh, start_keeper, token_of

pytestmark = pytest.mark.vm

async def restored(runtime, vm_id: str, checkpoint_id: str) -> None:
    await runtime.restore(vm_id, checkpoint_id)
    await runtime.wait_ready(vm_id, timeout=60)


def sha_of(machines, runtime, vm_id: str, path: str) -> str:
    return machines.run(sh(runtime, vm_id, f"sha256sum {path} | cut -d' ' -f1"))


def test_restore_brings_back_memory_disk_and_processes_byte_for_byte(machines, runtime):
    vm = machines.new()
    keeper = machines.run(start_keeper(runtime, vm))
    machines.run(sh(runtime, vm, "head -c 8M /dev/urandom > /home/boxd/data; sync"))
    data_sha = sha_of(machines, runtime, vm, "/home/boxd/data")
    token = machines.run(token_of(runtime, vm))
    checkpoint = machines.run(runtime.checkpoint(vm))

    # the episode changes everything it can: the file, a new file, the process itself
    machines.run(sh(runtime, vm, f"head -c 8M /dev/urandom > /home/boxd/data; touch /home/boxd/later; kill {keeper}; sync"))
    assert sha_of(machines, runtime, vm, "/home/boxd/data") != data_sha

    machines.run(restored(runtime, vm, checkpoint.id))
    assert sha_of(machines, runtime, vm, "/home/boxd/data") == data_sha
    assert machines.run(sh(runtime, vm, "ls /home/boxd/later 2>/dev/null || echo absent")) == "absent"
    assert machines.run(sh(runtime, vm, f"test -d /proc/{keeper} && echo alive")) == "alive"
    assert machines.run(token_of(runtime, vm)) == token


def test_the_same_checkpoint_restores_ten_times_in_a_row(machines, runtime):
    vm = machines.new()
    machines.run(start_keeper(runtime, vm))
    token = machines.run(token_of(runtime, vm))
    machines.run(sh(runtime, vm, "echo start > /home/boxd/episode; sync"))
    checkpoint = machines.run(runtime.checkpoint(vm))
    sockets = sorted(p.name for p in runtime._run_dir(vm).glob("*.sock"))

    for episode in range(10):
        # each episode begins exactly where the first did, whatever the last one did
        assert machines.run(sh(runtime, vm, "cat /home/boxd/episode")) == "start"
        assert machines.run(token_of(runtime, vm)) == token
        machines.run(sh(runtime, vm, f"echo episode-{episode} > /home/boxd/episode; sync"))
        machines.run(restored(runtime, vm, checkpoint.id))
    assert machines.run(sh(runtime, vm, "cat /home/boxd/episode")) == "start"

    # the same machine: same id, same sockets, its network still up
    info = machines.run(runtime.info(vm))
    assert info.id == vm and process_alive(info.pid, str(runtime._run_dir(vm)) + "/")
    assert sorted(p.name for p in runtime._run_dir(vm).glob("*.sock")) == sockets
    assert "10.0.2.15" in machines.run(sh(runtime, vm, "ip -4 addr show"))


def test_a_restored_machine_can_be_checkpointed_and_forked_again(machines, runtime):
    vm = machines.new()
    first = machines.run(runtime.checkpoint(vm))
    machines.run(sh(runtime, vm, "echo one > /home/boxd/n; sync"))
    machines.run(restored(runtime, vm, first.id))
    machines.run(sh(runtime, vm, "echo two > /home/boxd/n; sync"))
    second = machines.run(runtime.checkpoint(vm))
    fork = machines.track(f"{vm}-f")
    machines.run(fork_ready(runtime, vm, fork))
    assert machines.run(sh(runtime, fork, "cat /home/boxd/n")) == "two"

    machines.run(runtime.drop_checkpoint(vm, first.id))
    with pytest.raises(NotFound):
        machines.run(runtime.restore(vm, first.id))
    machines.run(sh(runtime, vm, "echo three > /home/boxd/n; sync"))
    machines.run(restored(runtime, vm, second.id))
    assert machines.run(sh(runtime, vm, "cat /home/boxd/n")) == "two"


def test_a_snapshot_outlives_its_machine_and_starts_many(machines, runtime, guest_image):
    vm = machines.new()
    machines.run(start_keeper(runtime, vm))
    token = machines.run(token_of(runtime, vm))
    machines.run(sh(runtime, vm, "head -c 4M /dev/urandom > /home/boxd/data; sync"))
    data_sha = sha_of(machines, runtime, vm, "/home/boxd/data")
    checkpoint = machines.run(runtime.checkpoint(vm))
    seen: list[tuple[int, int]] = []
    manifest = machines.run(runtime.save_snapshot(vm, checkpoint.id, progress=lambda done, total: seen.append((done, total))))
    assert seen and seen[-1][0] == seen[-1][1]
    assert (runtime.snapshots_dir / manifest.digest / "manifest.json").exists()
    machines.run(runtime.delete(vm))

    spec = VMSpec(image=str(guest_image.path))
    made = [machines.track(machines.id_for() + f"-{n}") for n in range(2)]
    for vm_id in made:
        machines.run(runtime.create(vm_id, spec, snapshot=manifest.digest))
    machines.run(gather(*(runtime.wait_ready(vm_id, 60) for vm_id in made)))
    for vm_id in made:
        assert sha_of(machines, runtime, vm_id, "/home/boxd/data") == data_sha
        assert machines.run(token_of(runtime, vm_id)) == token
    # two machines from one snapshot, and still their own random numbers
    uuids = {machines.run(sh(runtime, vm_id, "cat /proc/sys/kernel/random/uuid")) for vm_id in made}
    assert len(uuids) == 2


def test_a_corrupt_snapshot_is_refused_and_starts_nothing(machines, runtime, guest_image):
    vm = machines.new()
    checkpoint = machines.run(runtime.checkpoint(vm))
    manifest = machines.run(runtime.save_snapshot(vm, checkpoint.id))
    ram = runtime.snapshots_dir / manifest.digest / "ram.zst"
    damaged = bytearray(ram.read_bytes())
    damaged[len(damaged) // 2] ^= 0xFF
    ram.write_bytes(bytes(damaged))

    vm_id = machines.track(machines.id_for() + "-c")
    with pytest.raises(SnapshotUnusable, match="ram.zst is corrupt"):
        machines.run(runtime.create(vm_id, VMSpec(image=str(guest_image.path)), snapshot=manifest.digest))
    with pytest.raises(NotFound):
        machines.run(runtime.info(vm_id))
    assert not runtime._run_dir(vm_id).exists()
