"""Suspend, hibernate and wake; the port behind a machine's URL; isolation. Real VMs."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from boxd.runtime.interface import VMState
from boxd.runtime.qemu import process_alive

from guest import fork_ready, sh, start_keeper, token_of

pytestmark = pytest.mark.vm

COUNTER = "nohup sh -c 'i=0; while :; do i=$((i+1)); echo $i > /tmp/count; sleep 0.05; done' >/dev/null 2>&1 &"
WEB = "cd /home/boxd && nohup python3 -m http.server {port} >/dev/null 2>&1 &"


async def serving(runtime, vm_id: str, port: int = 8080) -> None:
    """An HTTP server in the guest, answering once it listens."""
    await sh(runtime, vm_id, WEB.format(port=port))
    await sh(runtime, vm_id, f"until python3 -c 'import urllib.request; urllib.request.urlopen(\"http://127.0.0.1:{port}/\")' 2>/dev/null; do sleep 0.2; done")


def fetch(runtime, vm_id: str, path: str) -> httpx.Response:
    port = runtime._machines[vm_id].url_port
    return httpx.get(f"http://127.0.0.1:{port}{path}", timeout=30)


def test_a_suspended_machine_stands_still_and_resumes(machines, runtime):
    vm = machines.new()
    machines.run(sh(runtime, vm, COUNTER))
    machines.run(runtime.suspend(vm))
    assert machines.run(runtime.info(vm)).state is VMState.PAUSED
    time.sleep(2)
    machines.run(runtime.resume(vm))
    before = int(machines.run(sh(runtime, vm, "cat /tmp/count")))
    assert machines.run(runtime.info(vm)).state is VMState.RUNNING
    machines.run(asyncio.sleep(1))
    assert int(machines.run(sh(runtime, vm, "cat /tmp/count"))) > before
    # its clock was set again: it does not lag by the time it stood still
    assert abs(float(machines.run(sh(runtime, vm, "date +%s.%N"))) - time.time()) < 2


def test_a_hibernated_machine_frees_its_memory_and_wakes_whole(machines, runtime):
    vm = machines.new()
    keeper = machines.run(start_keeper(runtime, vm))
    token = machines.run(token_of(runtime, vm))
    machines.run(sh(runtime, vm, "echo kept > /home/boxd/note; sync"))
    pid = machines.run(runtime.info(vm)).pid

    machines.run(runtime.hibernate(vm))
    info = machines.run(runtime.info(vm))
    assert info.state is VMState.STOPPED and info.pid is None
    assert not process_alive(pid, str(runtime._run_dir(vm)) + "/")
    assert not (runtime._run_dir(vm) / "ram").exists()  # its memory is given back
    assert (runtime._vm_dir(vm) / "hibernation.zst").exists()

    machines.run(runtime.resume(vm))
    machines.run(runtime.wait_ready(vm, 60))
    assert machines.run(token_of(runtime, vm)) == token
    assert machines.run(sh(runtime, vm, f"test -d /proc/{keeper} && echo alive")) == "alive"
    assert machines.run(sh(runtime, vm, "cat /home/boxd/note")) == "kept"
    assert not (runtime._vm_dir(vm) / "hibernation.zst").exists()


def test_a_fork_hibernates_and_wakes_owning_its_memory(machines, runtime):
    source = machines.new()
    machines.run(sh(runtime, source, "echo from-source > /home/boxd/note"))
    fork = machines.track(f"{source}-f")
    machines.run(fork_ready(runtime, source, fork))
    machines.run(runtime.hibernate(fork))
    machines.run(runtime.resume(fork))
    machines.run(runtime.wait_ready(fork, 60))
    assert machines.run(sh(runtime, fork, "cat /home/boxd/note")) == "from-source"
    assert runtime._machines[fork].ram_capture is None
    # and it can be forked in turn, like any machine that owns its RAM
    grandchild = machines.track(f"{source}-g")
    machines.run(fork_ready(runtime, fork, grandchild))
    assert machines.run(sh(runtime, grandchild, "cat /home/boxd/note")) == "from-source"


def test_the_url_port_leads_to_the_guest_and_stays_across_restore_and_hibernation(machines, runtime):
    vm = machines.new()
    machines.run(sh(runtime, vm, "echo hello > /home/boxd/index.txt"))
    machines.run(serving(runtime, vm))
    assert fetch(runtime, vm, "/index.txt").text == "hello\n"
    port = runtime._machines[vm].url_port

    checkpoint = machines.run(runtime.checkpoint(vm))
    fork = machines.track(f"{vm}-f")
    machines.run(fork_ready(runtime, vm, fork))
    machines.run(sh(runtime, fork, "echo fork > /home/boxd/index.txt"))
    assert runtime._machines[fork].url_port != port  # its own
    assert fetch(runtime, fork, "/index.txt").text == "fork\n"
    assert fetch(runtime, vm, "/index.txt").text == "hello\n"

    machines.run(sh(runtime, vm, "echo changed > /home/boxd/index.txt; sync"))
    machines.run(runtime.restore(vm, checkpoint.id))
    machines.run(runtime.wait_ready(vm, 60))
    assert runtime._machines[vm].url_port == port
    assert fetch(runtime, vm, "/index.txt").text == "hello\n"  # the server came back with it

    machines.run(runtime.hibernate(vm))
    machines.run(runtime.resume(vm))
    machines.run(runtime.wait_ready(vm, 60))
    assert fetch(runtime, vm, "/index.txt").text == "hello\n"


def test_no_machine_reaches_another_machines_url_port(machines, runtime):
    target, *others = machines.new_many({}, {}, {"isolated": True})
    machines.run(sh(runtime, target, "echo secret > /home/boxd/secret.txt"))
    machines.run(serving(runtime, target))
    port = runtime._machines[target].url_port
    assert fetch(runtime, target, "/secret.txt").text == "secret\n"

    probe = (
        "python3 -c 'import urllib.request,sys\n"
        "for host in (\"10.0.2.2\", \"127.0.0.1\"):\n"
        "    try: print(urllib.request.urlopen(f\"http://{host}:" + str(port) + "/secret.txt\", timeout=3).read())\n"
        "    except Exception as e: print(\"refused\", type(e).__name__)'"
    )
    for vm in others:
        answers = machines.run(sh(runtime, vm, probe)).splitlines()
        assert len(answers) == 2 and all(line.startswith("refused") for line in answers), (vm, answers)


def test_an_isolated_machine_has_a_url_port_too(machines, runtime):
    vm = machines.new(isolated=True)
    machines.run(sh(runtime, vm, "echo inside > /home/boxd/index.txt"))
    machines.run(serving(runtime, vm))
    assert fetch(runtime, vm, "/index.txt").text == "inside\n"
