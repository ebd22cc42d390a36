"""Nothing lost under concurrency: forks, creates, checkpoints and deletes from many
threads at once against one daemon with real VMs, for a bounded time.

At the end every machine whose create or fork was acknowledged and that was not deleted
becomes ready and answers; the daemon's folders hold nothing that no record names; and
the QEMU and passt processes on the host are exactly those of the machines that exist.
"""

from __future__ import annotations

import json
import random
import re
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
from daemon_process import print_log_if_failed, running_daemon

from boxd.config import shm_dir, vms_dir
from boxd.errors import Conflict, NotFound

pytestmark = pytest.mark.vm

WORKERS = 6
RUN_FOR_S = 45
MAX_LIVE = 8  # machines at once besides the root: 2 cores run them all under TCG
MEMORY_MIB = 256
# What a racing request may rightly be told: its machine went or is not running (yet).
EXPECTED_REFUSALS = (NotFound, Conflict)


@pytest.fixture(scope="module")
def daemon(guest_image):
    with running_daemon("boxd-race-") as process:
        yield process


@pytest.fixture(autouse=True)
def daemon_log_on_failure(request, daemon):
    yield
    print_log_if_failed(request, daemon)


class Ledger:
    """What the daemon acknowledged, shared by the workers."""

    def __init__(self, root: str) -> None:
        self.lock = threading.Lock()
        self.live: set[str] = set()
        self.root = root
        # Which machines descend from the root (and so hold its token file); new ones do not.
        self.from_root: set[str] = {root}
        self.done: Counter[str] = Counter()
        self.refused: Counter[str] = Counter()
        self.unexpected: list[str] = []
        self.serial = 0

    def name(self, kind: str) -> str:
        with self.lock:
            self.serial += 1
            return f"{kind}-{self.serial}"

    def pick(self) -> str | None:
        with self.lock:
            return random.choice(sorted(self.live)) if self.live else None

    def room(self) -> bool:
        with self.lock:
            return len(self.live) < MAX_LIVE


def _work(boxd, ledger: Ledger, deadline: float, seed: int) -> None:
    chance = random.Random(seed)
    while time.monotonic() < deadline:
        op = chance.choice(["fork", "fork", "fork", "create", "checkpoint", "delete", "delete"])
        if op in ("fork", "create") and not ledger.room():
            op = "delete"
        target = ledger.pick() if op != "fork" or chance.random() < 0.5 else ledger.root
        try:
            if op == "fork":
                target = target or ledger.root
                made = boxd.machines.fork(target, ledger.name("fork"))
            elif op == "create":
                made = boxd.machines.new(ledger.name("new"), memory_mib=MEMORY_MIB)
            elif target is None:
                continue
            elif op == "checkpoint":
                boxd.machines.checkpoints.save(target, ledger.name("cp"))
            else:
                with ledger.lock:
                    ledger.live.discard(target)  # from here on nobody should count on it
                boxd.machines.delete(target)
            if op in ("fork", "create"):
                with ledger.lock:
                    ledger.live.add(made.id)
                    if op == "fork" and target in ledger.from_root:
                        ledger.from_root.add(made.id)
            ledger.done[op] += 1
        except EXPECTED_REFUSALS:
            ledger.refused[op] += 1
        except Exception as error:  # noqa: BLE001 - every other answer is a lost request
            ledger.unexpected.append(f"{op} {target}: {type(error).__name__}: {error}")


def _named_on_disk(home: Path) -> tuple[set[str], set[str]]:
    """The layers and captures that the machines' records name."""
    layers, captures = set(), set()
    for record in vms_dir(home).glob("*/machine.json"):
        data = json.loads(record.read_text())
        layers.add(data["disk_top"])
        layers.update(data["disk_frozen"])
        if data.get("ram_capture"):
            captures.add(data["ram_capture"])
        for capture, chain in data["checkpoints"].items():
            captures.add(capture)
            layers.update(chain)
    return layers, captures


def _processes_under(shm: Path) -> tuple[Counter[str], Counter[str], list[str]]:
    """QEMU and passt processes per machine id (by the run folder their pidfile or socket
    is in), and any template QEMU of a capture still running."""
    qemus, passts, templates = Counter(), Counter(), []
    run_file = re.compile(re.escape(str(shm)) + r"/([^/\s]+)/(qemu\.pid|net\.sock)")
    for cmdline in Path("/proc").glob("[0-9]*/cmdline"):
        try:
            text = cmdline.read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if f"{shm}/captures/" in text and "/template/" in text:
            templates.append(text[:300])
        elif found := run_file.search(text):
            (qemus if found.group(2) == "qemu.pid" else passts)[found.group(1)] += 1
    return qemus, passts, templates


def test_forks_creates_checkpoints_and_deletes_at_once_lose_nothing(daemon):
    boxd = daemon.sdk()
    root = boxd.machines.new("root", memory_mib=MEMORY_MIB)
    boxd.machines.wait_until_ready(root.id, timeout=300)
    boxd.machines.exec(root.id, "echo $RANDOM > /home/boxd/token")
    ledger = Ledger(root.id)

    deadline = time.monotonic() + RUN_FOR_S
    with ThreadPoolExecutor(WORKERS) as pool:
        for worker in pool.map(lambda n: _work(daemon.sdk(), ledger, deadline, n), range(WORKERS)):
            pass
    print(f"\ndone {dict(ledger.done)} refused {dict(ledger.refused)} live {len(ledger.live)}")
    assert not ledger.unexpected, "\n".join(ledger.unexpected)
    assert ledger.done["fork"] >= 5 and ledger.done["delete"] >= 3 and ledger.done["create"] >= 1, ledger.done

    token = boxd.machines.exec(root.id, "cat /home/boxd/token").stdout
    for machine_id in sorted(ledger.live | {root.id}):
        boxd.machines.wait_until_ready(machine_id, timeout=300)
        answer = boxd.machines.exec(machine_id, "echo alive; cat /home/boxd/token 2>/dev/null")
        expected = "alive\n" + (token if machine_id in ledger.from_root else "")
        assert answer.stdout == expected, (machine_id, answer.stdout)

    alive = {m.id for m in boxd.machines.list()}
    assert alive == ledger.live | {root.id}
    assert not [m for m in boxd.machines.list() if m.state.value == "failed"]

    # Nothing on disk that no record names, and a record for each machine alive only.
    home, shm = daemon.home, shm_dir(daemon.home)
    assert {p.name for p in vms_dir(home).iterdir()} == alive
    layers, captures = _named_on_disk(home)
    assert {p.name for p in (home / "layers").glob("*")} == layers
    assert {p.name for p in (shm / "captures").iterdir()} == captures
    assert {p.name for p in shm.iterdir()} - {"captures"} == alive  # run folders

    qemus, passts, templates = _processes_under(shm)
    assert not templates, templates
    assert qemus == Counter({machine: 1 for machine in alive})
    assert passts == Counter({machine: 1 for machine in alive})  # none of them is isolated

    for machine_id in alive:
        boxd.machines.delete(machine_id)
    qemus, passts, templates = _processes_under(shm)
    assert not qemus and not passts and not templates
    assert not list((home / "layers").glob("*"))
