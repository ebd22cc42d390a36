"""boxd across hosts on Ray: placing machines, and forks on the same host against forks
onto another host.

    python bench/cluster.py [--quick] [--machines 20] [--forks 5] [--json out.json]

One run, on a Ray cluster of raylets on this machine (``ray.cluster_utils``: a head and
two nodes that offer ``boxd_host``, each host agent with a state folder of its own),
driving ``RayRuntime`` as the daemon does:

- placement: --machines machines of 256 MiB created one after another, each ``create``
  timed until its QEMU runs (placement, the agent's call, the launch), and where each
  one went; then all of them deleted but one per host;
- forks: a 512 MiB source (on host A, where it was placed) in which a process holds
  150 MiB of random bytes; --forks forks on host A and --forks onto host B, alternately, each timed from
  the call until its agent answers, with the source's pause, the bytes of memory the
  migration sent and the bytes of disk layer the other host copied (zero when it held
  that layer already), as ``RayRuntime`` records them;
- the ratio of the median cross-host fork to the median same-host fork.

All the hosts share this machine's two cores and its memory: a migration "over the
network" runs over loopback here, and placing 20 machines also boots 20 guests at once.
``--quick``: 10 machines, 3 forks of each kind.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from pathlib import Path
from typing import Any

from _common import (
    HOLDER,
    HOLDER_PATH,
    Report,
    TrackedMachines,
    base_parser,
    bench_image,
    console,
    host_facts,
    median,
    mib,
    ms,
    run,
    start_filling,
    summary,
)

import ray
from ray.cluster_utils import Cluster

from boxd.cluster.ray_runtime import NAMESPACE, RayRuntime
from boxd.runtime.interface import VMSpec
from boxd.runtime.local import LocalRuntime

SOURCE_MIB = 512
PLACED_MIB = 256
READY_TIMEOUT = 300


class RayBench(TrackedMachines):
    """Machines on a ``RayRuntime``; the tracked ones are deleted on the way out, then
    whatever the host folders still hold."""

    def __init__(self, runtime: RayRuntime, image_digest: str) -> None:
        super().__init__()
        self.runtime = runtime
        self.image_digest = image_digest

    def spec(self, memory_mib: int) -> VMSpec:
        return VMSpec(image=self.image_digest, memory_mib=memory_mib)


async def sweep_hosts(root: Path) -> None:
    """Every machine of every host folder, deleted straight through a LocalRuntime."""
    for home in root.glob("*"):
        runtime = LocalRuntime(home)
        for vm_dir in (home / "vms").glob("*"):
            try:
                await runtime.delete(vm_dir.name)
            except Exception:  # noqa: BLE001 -- gone already
                pass
        await runtime.close()


async def main(args) -> None:
    machines = args.machines or (10 if args.quick else 20)
    forks = args.forks or (3 if args.quick else 5)
    report = Report("cluster", vars(args) | {"json": str(args.json) if args.json else None,
                                             "machines": machines, "forks": forks})
    report.host = host_facts()
    image = bench_image()
    root = Path(tempfile.mkdtemp(prefix="boxd-bench-cluster-"))
    cluster = Cluster(initialize_head=True, head_node_args={"num_cpus": 1, "include_dashboard": False})
    for _ in range(2):
        cluster.add_node(num_cpus=1, resources={"boxd_host": 1})
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, namespace=NAMESPACE, log_to_driver=False)
    runtime = RayRuntime(cluster.address, host_root=root / "hosts", daemon_home=image.path.parent.parent)
    bench = RayBench(runtime, image.digest)
    try:
        await runtime.start()
        await placement(bench, report, machines)
        await fork_pairs(bench, report, forks)
    finally:
        for vm_id in list(bench.tracked):
            await bench.delete(vm_id)
        await runtime.close()
        ray.shutdown()
        cluster.shutdown()
        await sweep_hosts(root / "hosts")
        shutil.rmtree(root, ignore_errors=True)
    report.print_targets()
    report.write_json(args.json)


async def placement(bench: RayBench, report: Report, count: int) -> None:
    timings, hosts = [], []
    started = time.monotonic()
    with console.status(f"placing {count} machines of {PLACED_MIB} MiB"):
        for index in range(count):
            vm_id = bench.track(f"placed-{index}")
            began = time.monotonic()
            info = await bench.runtime.create(vm_id, bench.spec(PLACED_MIB))
            timings.append(time.monotonic() - began)
            hosts.append(info.host)
    total = time.monotonic() - started
    spread = {host: hosts.count(host) for host in sorted(set(hosts))}
    report.results["placement"] = {"total_s": total, "create_s": summary(timings), "spread": spread}
    report.table(
        f"Placing {count} machines ({PLACED_MIB} MiB each), create -> QEMU running",
        ["metric", "value"],
        [
            ["all of them", ms(total)],
            ["one create, median", ms(median(timings))],
            ["one create, slowest", ms(max(timings))],
            *[[f"on {host}", str(n)] for host, n in spread.items()],
        ],
    )
    keep = {hosts.index(host) for host in spread}
    for index in range(count):
        if index not in keep:
            await bench.delete(f"placed-{index}")


async def fork_pairs(bench: RayBench, report: Report, count: int) -> None:
    runtime = bench.runtime
    source = bench.track("source")
    with console.status(f"source: {SOURCE_MIB} MiB, filling 150 MiB"):
        info = await runtime.create(source, bench.spec(SOURCE_MIB))
        await runtime.wait_ready(source, READY_TIMEOUT)
        await start_filling(bench, source, HOLDER_PATH, HOLDER, 150)
    host_a = info.host
    host_b = next(name for name in await runtime.hosts() if name != host_a)
    rows: dict[str, list[dict[str, Any]]] = {"same host": [], "another host": []}
    for index in range(count):
        for kind, host in (("same host", host_a), ("another host", host_b)):
            vm_id = bench.track(f"fork-{index}-{'a' if host == host_a else 'b'}")
            moved_before = len(runtime.moved)
            with console.status(f"fork {index + 1}/{count} onto {kind}"):
                began = time.monotonic()
                await runtime.fork(source, [vm_id], host=host)
                forked = time.monotonic()
                await runtime.wait_ready(vm_id, READY_TIMEOUT)
                ready = time.monotonic()
            moved = runtime.moved[moved_before] if len(runtime.moved) > moved_before else {}
            rows[kind].append({"fork_s": forked - began, "ready_s": ready - began, **moved})
            await bench.delete(vm_id)
    same = [r["ready_s"] for r in rows["same host"]]
    across = [r["ready_s"] for r in rows["another host"]]
    ram = [r["ram_bytes"] for r in rows["another host"]]
    layers = [r["layer_bytes"] for r in rows["another host"]]
    pauses = [r["pause_s"] for r in rows["another host"]]
    report.results["forks"] = {"same_host": rows["same host"], "another_host": rows["another host"],
                               "ratio_of_medians": median(across) / median(same)}
    report.table(
        f"Forks of a {SOURCE_MIB} MiB source holding 150 MiB, call -> agent answering",
        ["fork onto", "median", "all runs", "x same host"],
        [
            ["same host", ms(median(same)), ", ".join(ms(x) for x in same), "1.00x"],
            ["another host", ms(median(across)), ", ".join(ms(x) for x in across),
             f"{median(across) / median(same):.2f}x"],
        ],
    )
    report.table(
        "What a fork onto another host moved",
        ["metric", "median", "all runs"],
        [
            ["memory sent by the migration", mib(median(ram)), ", ".join(mib(x) for x in ram)],
            ["disk layer copied", mib(median(layers)), ", ".join(mib(x) for x in layers)],
            ["source paused", ms(median(pauses)), ", ".join(ms(x) for x in pauses)],
        ],
    )


if __name__ == "__main__":
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="10 machines, 3 forks of each kind")
    parser.add_argument("--machines", type=int, help="machines to place (default 20, quick 10)")
    parser.add_argument("--forks", type=int, help="forks of each kind (default 5, quick 3)")
    arguments = parser.parse_args()
    raise SystemExit(run(lambda: main(arguments)))
