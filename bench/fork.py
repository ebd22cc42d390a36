"""Forks of a running machine: latency, source pause, memory and disk per fork, baselines.

    python bench/fork.py [--json out.json] [--quick]

All in one run, so that every ratio compares numbers measured on the same machine at
about the same time:

- baselines: a bare process start (the fork's own command line, ``-incoming``, from
  nothing until its QMP socket answers ``query-status``) and a fresh boot plus a
  warm-up command;
- fork latency (``fork`` called until the fork's agent answers) for 1 fork at a time
  and for 8 and 32 concurrent forks of one 512 MiB source, and where that time goes;
- the source's pause (the runtime's ``capture taken ... pause_ms=`` log line) for a
  256 MiB and a 1 GiB source holding 150 / 700 MiB of random bytes, and what a process
  in the guest noticed;
- PSS of each idle fork's QEMU against the source's, and bytes per fork.

``--quick``: 1 and 4 forks, the 256 MiB pause only, fewer repetitions (a smoke run).
"""

from __future__ import annotations

import asyncio
import collections
import json
import os
import shutil
import time
from pathlib import Path
from typing import Any, Self

import boxd.runtime.local as local_module
from boxd.runtime.agent_client import AgentClient
from boxd.runtime.local import stop_processes
from boxd.runtime.network import start_passt
from boxd.runtime.qemu import Launch, Monitor, create_overlay, start_qemu

from _common import (
    FILL_MEMORY,
    Bench,
    LogCapture,
    MiB,
    Report,
    allocated_bytes,
    base_parser,
    bench_image,
    console,
    host_facts,
    median,
    mem_available,
    mib,
    ms,
    percentile,
    run,
    smaps_rollup,
    start_filling,
    summary,
)

SOURCE_MIB = 512
WARM_UP = ["python3", "-c", "import json, hashlib, sqlite3, email, http.client"]
GAP_MS = 5  # the guest's recorder writes down every gap longer than this

# Fills (and holds) some memory with random bytes, then records every gap of over
# GAP_MS between 1 ms sleeps, by the guest's own monotonic and wall clocks.
FILLER = FILL_MEMORY + r"""
open("/tmp/filled", "w").close()
out = open("/tmp/gaps", "a", buffering=1)
mono, wall = time.monotonic(), time.time()
while True:
    time.sleep(0.001)
    m, w = time.monotonic(), time.time()
    if m - mono > GAP or w - wall > GAP:
        out.write(f"{(m - mono) * 1000:.1f} {(w - wall) * 1000:.1f}\n")
    mono, wall = m, w
""".replace("GAP", str(GAP_MS / 1000))

# A fork's life as marks in time order, each with the label of the stretch that ends at
# it. A mark that did not happen (no passt for an isolated machine, a function renamed)
# folds its stretch into the next one.
# A fork's QEMU starts as soon as the capture's instant is fixed, while the source's
# memory still streams into the template, and then waits for the capture to end.
FORK_MARKS = [
    ("call", None),
    ("overlay_begin", "until the capture's instant"),
    ("overlay_end", "qcow2 overlay (qemu-img)"),
    ("passt_end", "network: passt start"),
    ("qemu_end", "QEMU start (-daemonize)"),
    ("qmp_end", "QMP connect"),
    ("capture_end", "rest of the capture (memory streaming)"),
    ("incoming_end", "state load (migrate-incoming)"),
    ("returned", "cont, fork() returns"),
    ("ping_end", "agent answers ping"),
    ("ready", "set guest clock"),
]
FORK_PHASES = [label for _, label in FORK_MARKS if label]
CAPTURE_PHASES = ["before the pause", "pause (runtime log)", "after the pause", "capture total"]


class Tracer:
    """Timestamps of what the runtime does, taken from outside it.

    The functions the runtime calls are wrapped in the bench's own process for the
    run; the runtime's code is not changed. ``marks[key][name]`` is the last time
    ``name`` happened for ``key`` (a machine id); ``events`` keeps every wrapped call,
    QMP commands included, as (begin, end, key, what).
    """

    def __init__(self, runtime: local_module.LocalRuntime) -> None:
        self.runtime = runtime
        self.marks: dict[str, dict[str, float]] = collections.defaultdict(dict)
        self.events: list[tuple[float, float, str, str]] = []
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def mark(self, key: str, name: str) -> None:
        self.marks[key][name] = time.monotonic()

    def _wrap(self, owner: Any, attr: str, label: str, key_of, instance: bool = False, what=None) -> None:
        original = getattr(owner, attr, None)
        if original is None:
            console.print(f"[yellow]tracer: {attr} not found in the runtime; its stretch folds into the next[/yellow]")
            return

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = key_of(*args, **kwargs)
            begin = time.monotonic()
            self.marks[key][f"{label}_begin"] = begin
            try:
                return await original(*args, **kwargs)
            finally:
                end = time.monotonic()
                self.marks[key][f"{label}_end"] = end
                self.events.append((begin, end, key, what(*args, **kwargs) if what else label))

        setattr(owner, attr, wrapper)
        self._undo.append((owner, attr, original, instance))

    def __enter__(self) -> Self:
        rt, mod = self.runtime, local_module
        self._wrap(mod, "create_overlay", "overlay", lambda path, *a, **k: Path(path).name.rsplit("-", 1)[0])
        self._wrap(mod, "start_passt", "passt", lambda run_dir, *a, **k: Path(run_dir).name)
        self._wrap(mod, "start_qemu", "qemu", lambda launch, *a, **k: launch.name)
        self._wrap(mod, "wait_incoming", "incoming", lambda monitor, *a, **k: monitor.name)
        self._wrap(mod, "wait_migration", "migration", lambda monitor, *a, **k: monitor.name)
        self._wrap(rt, "_monitor", "qmp", lambda vm_id, *a, **k: vm_id, instance=True)
        self._wrap(rt, "_capture", "capture", lambda source, *a, **k: source.id, instance=True)
        self._wrap(rt, "_shorten_chain", "shorten", lambda source, *a, **k: source.id, instance=True)
        self._wrap(AgentClient, "connect", "ping", lambda client, *a, **k: client.name)
        self._wrap(Monitor, "execute", "execute", lambda monitor, *a, **k: monitor.name,
                   what=lambda monitor, command, *a, **k: f"QMP {command}")
        return self

    def __exit__(self, *exc_info: object) -> None:
        for owner, attr, original, instance in reversed(self._undo):
            if instance:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)

    def fork_phases(self, vm_id: str, source_id: str) -> dict[str, float]:
        """Seconds per stretch of FORK_MARKS for one fork (the capture's end is its source's)."""
        marks = dict(self.marks.get(vm_id, {}))
        if "capture_end" in self.marks.get(source_id, {}):
            marks["capture_end"] = self.marks[source_id]["capture_end"]
        out: dict[str, float] = {}
        previous = None
        for name, label in FORK_MARKS:
            if name not in marks:
                continue
            if previous is not None:
                out[label] = marks[name] - marks[previous]
            previous = name
        return out

    def capture(self, source_id: str, pause_ms: float | None) -> dict[str, Any]:
        """The last capture of ``source_id``: its stretches and a timeline of what ran in it."""
        marks = self.marks.get(source_id, {})
        begin, end = marks.get("capture_begin"), marks.get("capture_end")
        if begin is None or end is None:
            return {"phases": {}, "timeline": []}
        inside = sorted(
            (e for e in self.events
             if begin <= e[0] <= end and (e[2] == source_id or e[2].startswith("capture-") or e[2] == "template")),
            key=lambda e: e[0],
        )
        timeline: list[dict[str, Any]] = []
        for b, e, key, what in inside:
            who = "source" if key == source_id else "template"
            last = timeline[-1] if timeline else None
            if last and last["who"] == who and last["what"] == what:  # polling: one row
                last["count"] += 1
                last["end"] = e - begin
                continue
            timeline.append({"at": b - begin, "end": e - begin, "who": who, "what": what, "count": 1})
        phases = {"capture total": end - begin}
        stop = next((t for t in timeline if t["who"] == "source" and t["what"] == "QMP stop"), None)
        if stop is not None and pause_ms is not None:
            phases["before the pause"] = stop["at"]
            phases["pause (runtime log)"] = pause_ms / 1000
            phases["after the pause"] = (end - begin) - stop["at"] - pause_ms / 1000
        return {"phases": phases, "timeline": timeline}


class ForkBench:
    def __init__(self, bench: Bench, report: Report, tracer: Tracer, logs: LogCapture, args) -> None:
        self.bench = bench
        self.runtime = bench.runtime
        self.report = report
        self.tracer = tracer
        self.logs = logs
        self.args = args
        self.tag = os.getpid() % 10000
        self.rounds = 0

    # -- baselines ------------------------------------------------------------------------

    async def boot_and_warm(self, vm_id: str, memory_mib: int) -> dict[str, float]:
        started = time.monotonic()
        timings = await self.bench.boot(vm_id, memory_mib=memory_mib)
        warm_started = time.monotonic()
        code = await self.bench.argv(vm_id, WARM_UP)
        if code != 0:
            raise RuntimeError(f"warm-up exited {code}")
        done = time.monotonic()
        return timings | {"warm_up_s": done - warm_started, "total_s": done - started}

    async def bare_qemu_start(self, index: int, memory_mib: int) -> dict[str, float]:
        """The runtime's command line for a fork (``-incoming``, its default network), from
        nothing running until QMP answers ``query-status``. Like the runtime, the machine's
        passt is started first when the command line needs one; it is timed apart."""
        runtime, image = self.runtime, self.bench.image
        name = f"bare{self.tag}-{index}"
        run_dir = runtime.shm_dir / name  # under shm_dir: the bench's final sweep ends it
        run_dir.mkdir(parents=True)
        ram = run_dir / "ram"
        ram.touch()
        os.truncate(ram, memory_mib * MiB)  # sparse, like a RAM file nothing has written yet
        disk = runtime.layers_dir / f"{name}.qcow2"
        await create_overlay(disk, image.rootfs)
        launch = Launch(
            name=name, run_dir=run_dir, ram_file=ram, ram_shared=False, disk=disk,
            kernel=image.kernel, initrd=image.initrd, console_log=run_dir / "console.log",
            accelerator=runtime.accelerator, vcpus=1, memory_mib=memory_mib, isolated=False, incoming=True,
        )
        monitor = Monitor(launch.qmp_socket, name)
        try:
            started = time.monotonic()
            if not launch.isolated:
                await start_passt(run_dir)
            network = time.monotonic()
            await start_qemu(launch)
            launched = time.monotonic()
            await monitor.connect()
            status = await monitor.execute("query-status")
            answered = time.monotonic()
            if status.get("status") != "inmigrate":
                console.print(f"[yellow]bare QEMU status {status}[/yellow]")
        finally:
            await monitor.close()
            await stop_processes(run_dir)
            shutil.rmtree(run_dir, ignore_errors=True)
            disk.unlink(missing_ok=True)
        return {
            "total_s": answered - started,
            "network_s": network - started,
            "qemu_s": answered - network,
            "launch_s": launched - network,
            "qmp_s": answered - launched,
        }

    # -- forks ----------------------------------------------------------------------------

    async def fork_round(self, source: str, count: int) -> dict[str, Any]:
        """``count`` concurrent fork calls of one id each, each followed by wait_ready."""
        self.rounds += 1
        ids = [self.bench.track(f"f{self.tag}-{self.rounds}-{n}") for n in range(count)]
        self.tracer.marks.pop(source, None)
        logs_before = len(self.logs.records)

        async def one(vm_id: str) -> dict[str, Any]:
            self.tracer.mark(vm_id, "call")
            started = time.monotonic()
            infos = await self.runtime.fork(source, [vm_id])
            self.tracer.mark(vm_id, "returned")
            await self.runtime.wait_ready(vm_id, timeout=max(120, 10 * count))
            self.tracer.mark(vm_id, "ready")
            return {"id": vm_id, "pid": infos[0].pid, "latency_s": time.monotonic() - started}

        round_started = time.monotonic()
        forks = await asyncio.gather(*(one(vm_id) for vm_id in ids))
        all_ready = time.monotonic() - round_started
        for fork in forks:
            fork["phases"] = self.tracer.fork_phases(fork["id"], source)
        messages = [r.getMessage() for r in self.logs.records[logs_before:]]
        pauses = [float(m.rsplit("pause_ms=", 1)[1].split()[0])
                  for m in messages if "capture taken" in m and f"source={source} " in m]
        capture = self.tracer.capture(source, pauses[-1] if pauses else None)
        return {
            "count": count,
            "ids": ids,
            "forks": forks,
            "all_ready_s": all_ready,
            "captures": len(pauses),
            "pause_ms": pauses,
            "capture_phases": capture["phases"],
            "capture_timeline": capture["timeline"],
            "runtime_log": messages,
        }

    async def footprint(self, source_pid: int, round_: dict[str, Any]) -> dict[str, Any]:
        """PSS of each idle fork's QEMU and of the source's; bytes per fork."""
        await asyncio.sleep(self.args.settle)
        runtime = self.runtime
        source_memory = smaps_rollup(source_pid)
        users = collections.Counter(
            json.loads(record.read_text()).get("ram_capture") for record in runtime.vms_dir.glob("*/machine.json")
        )
        per_fork = []
        for fork in round_["forks"]:
            record = self.bench.machine_record(fork["id"])
            capture = record["ram_capture"]
            capture_bytes = allocated_bytes(runtime.captures_dir / capture)
            per_fork.append(
                {
                    "id": fork["id"],
                    "memory": smaps_rollup(fork["pid"]),
                    "top_layer_bytes": allocated_bytes(runtime.layers_dir / record["disk_top"]),
                    "capture_bytes": capture_bytes,
                    "capture_users": users[capture],
                    "capture_share_bytes": capture_bytes / users[capture],
                }
            )
        return {"source_memory": source_memory, "forks": per_fork}

    async def delete_round(self, round_: dict[str, Any]) -> None:
        for vm_id in round_["ids"]:
            await self.bench.delete(vm_id)

    # -- pause ----------------------------------------------------------------------------

    async def pause_series(self, memory_mib: int, fill_mib: int, runs: int) -> dict[str, Any]:
        bench, runtime = self.bench, self.runtime
        source = f"p{self.tag}-{memory_mib}"
        with console.status(f"pause: booting a {memory_mib} MiB source, filling {fill_mib} MiB"):
            await bench.boot(source, memory_mib=memory_mib)
            await start_filling(bench, source, "/tmp/filler.py", FILLER, fill_mib)
        guest_used = await bench.sh(source, "free -m | awk '/Mem:/ {print $3}'")

        async def gaps() -> tuple[float, float]:
            text = await bench.sh(source, "cat /tmp/gaps; : > /tmp/gaps")
            rows = [tuple(map(float, line.split())) for line in text.splitlines() if line.strip()]
            return (max((r[0] for r in rows), default=0.0), max((r[1] for r in rows), default=0.0))

        # What the guest's clocks make of a deliberate 500 ms stop of its vCPUs.
        calibration = None
        if hasattr(runtime, "_monitor"):
            monitor = await runtime._monitor(source)
            await gaps()
            await monitor.execute("stop")
            await asyncio.sleep(0.5)
            await monitor.execute("cont")
            await asyncio.sleep(0.3)
            calibration = await gaps()

        samples, noise = [], []
        for index in range(runs):
            await gaps()
            await asyncio.sleep(2.0)  # the guest's own noise floor: same reads, no fork
            noise.append(await gaps())
            with console.status(f"pause {memory_mib} MiB: fork {index + 1}/{runs}"):
                round_ = await self.fork_round(source, 1)
                await asyncio.sleep(0.5)
                seen = await gaps()
                capture = bench.machine_record(round_["ids"][0])["ram_capture"]
                ram_bytes = allocated_bytes(runtime.captures_dir / capture / "ram")
                source_memory = smaps_rollup((await runtime.info(source)).pid)
                await self.delete_round(round_)
            sample = {
                "pause_ms": round_["pause_ms"][-1] if round_["pause_ms"] else None,
                "capture_phases": round_["capture_phases"],
                "capture_timeline": round_["capture_timeline"],
                "capture_ram_bytes": ram_bytes,
                "source_memory": source_memory,
                "guest_gap_monotonic_ms": seen[0],
                "guest_gap_wall_ms": seen[1],
                "fork_latency_s": round_["forks"][0]["latency_s"],
            }
            samples.append(sample)
            console.print(
                f"pause {memory_mib} MiB #{index + 1}: {sample['pause_ms']:.0f} ms, fork ready in "
                f"{ms(sample['fork_latency_s'])} (capture RAM {mib(ram_bytes)}; guest saw "
                f"{seen[0]:.0f} ms monotonic / {seen[1]:.0f} ms wall, noise {noise[-1][0]:.0f} / {noise[-1][1]:.0f})"
            )
        await bench.delete(source)
        return {
            "memory_mib": memory_mib,
            "filled_mib": fill_mib,
            "guest_used_mib": int(guest_used) if guest_used.isdigit() else guest_used,
            "samples": samples,
            "noise_gap_monotonic_ms": [n[0] for n in noise],
            "noise_gap_wall_ms": [n[1] for n in noise],
            "stop_500ms_seen_by_guest_ms": calibration,
            "pause_ms": summary([s["pause_ms"] for s in samples if s["pause_ms"] is not None]),
        }


def _median_phases(phase_dicts: list[dict[str, float]], labels: list[str]) -> dict[str, float]:
    out = {}
    for label in labels:
        values = [d[label] for d in phase_dicts if label in d]
        if values:
            out[label] = median(values)
    return out


def _plural(count: int) -> str:
    return f"{count} fork" + ("s" if count > 1 else "")


async def main(args) -> None:
    quick = args.quick
    single_runs = args.single_runs or (3 if quick else 5)
    counts = args.concurrent or ([4] if quick else [8, 32])
    pause_sizes = [(256, 150)] if quick else [(256, 150), (1024, 700)]
    pause_runs = args.pause_runs or (3 if quick else 5)
    boot_runs = 1 if quick else 3
    bare_runs = 3 if quick else 5

    report = Report("fork", vars(args) | {"json": str(args.json) if args.json else None})
    image = bench_image()
    async with Bench(image, keep_home=args.keep_home) as bench:
        runtime = bench.runtime
        report.host = host_facts(runtime)
        results = report.results
        with LogCapture("boxd.runtime.local") as logs, Tracer(runtime) as tracer:
            fb = ForkBench(bench, report, tracer, logs, args)

            # -- baseline: boot + warm-up; the last machine booted is the forks' source --
            boots = []
            for index in range(boot_runs):
                vm_id = f"s{fb.tag}-{index}"
                with console.status(f"baseline: boot + warm-up {index + 1}/{boot_runs}"):
                    boots.append(await fb.boot_and_warm(vm_id, SOURCE_MIB))
                console.print(
                    f"boot + warm-up {index + 1}: {ms(boots[-1]['total_s'])} "
                    f"(boot {ms(boots[-1]['ready_s'])}, warm-up {ms(boots[-1]['warm_up_s'])})"
                )
                if index < boot_runs - 1:
                    await bench.delete(vm_id)
            source = f"s{fb.tag}-{boot_runs - 1}"
            source_pid = (await runtime.info(source)).pid
            source_before = smaps_rollup(source_pid)
            results["boot_warm"] = {
                "total": summary([b["total_s"] for b in boots]),
                "boot_s": [b["ready_s"] for b in boots],
                "warm_up_s": [b["warm_up_s"] for b in boots],
            }
            results["source_memory_before_forks"] = source_before

            # -- baseline: bare process start (the source idles meanwhile, as during forks)
            bares = []
            for index in range(bare_runs):
                with console.status(f"baseline: bare QEMU start {index + 1}/{bare_runs}"):
                    bares.append(await fb.bare_qemu_start(index, SOURCE_MIB))
            results["bare_start"] = {
                "total": summary([b["total_s"] for b in bares]),
                **{key: [b[key] for b in bares] for key in ("network_s", "qemu_s", "launch_s", "qmp_s")},
            }
            bare = median([b["total_s"] for b in bares])
            bare_qemu = median([b["qemu_s"] for b in bares])
            boot_warm = median([b["total_s"] for b in boots])
            report.table(
                "Baselines",
                ["baseline", "median", "all runs", "parts (median)"],
                [
                    [
                        f"bare start -> QMP query-status ({SOURCE_MIB} MiB, the fork's command line)",
                        ms(bare),
                        ", ".join(ms(b["total_s"]) for b in bares),
                        (f"passt {ms(median([b['network_s'] for b in bares]))}, "
                         f"QEMU launch {ms(median([b['launch_s'] for b in bares]))}, "
                         f"QMP {ms(median([b['qmp_s'] for b in bares]))}"),
                    ],
                    [
                        "fresh boot + warm-up",
                        ms(boot_warm),
                        ", ".join(ms(b["total_s"]) for b in boots),
                        (f"boot {ms(median([b['ready_s'] for b in boots]))}, "
                         f"warm-up {ms(median([b['warm_up_s'] for b in boots]))}"),
                    ],
                ],
            )

            # -- fork latency ----------------------------------------------------------
            singles = []
            for index in range(single_runs):
                with console.status(f"1 fork, run {index + 1}/{single_runs}"):
                    round_ = await fb.fork_round(source, 1)
                    round_["footprint"] = await fb.footprint(source_pid, round_)
                    await fb.delete_round(round_)
                singles.append(round_)
                console.print(f"1 fork #{index + 1}: {ms(round_['forks'][0]['latency_s'])} "
                              f"(source pause {', '.join(f'{p:.0f}' for p in round_['pause_ms'])} ms)")
            rounds = {1: singles}
            for count in counts:
                need = count * 160 * MiB + 2 * SOURCE_MIB * MiB + 1024 * MiB
                if mem_available() < need:
                    report.note(f"{count} concurrent forks skipped: {mib(mem_available())} available, want {mib(need)}")
                    continue
                with console.status(f"{count} concurrent forks"):
                    round_ = await fb.fork_round(source, count)
                    round_["footprint"] = await fb.footprint(source_pid, round_)
                    await fb.delete_round(round_)
                rounds[count] = [round_]
                console.print(f"{count} concurrent forks: all ready in {ms(round_['all_ready_s'])}")
            results["fork_rounds"] = {str(k): v for k, v in rounds.items()}

            one = percentile([f["latency_s"] for r in singles for f in r["forks"]], 50)
            latency: dict[int, dict[str, float]] = {}
            rows = []
            for count, group in rounds.items():
                values = [f["latency_s"] for r in group for f in r["forks"]]
                ready_all = median([r["all_ready_s"] for r in group])
                latency[count] = {"p50": percentile(values, 50), "p95": percentile(values, 95), "all_ready": ready_all}
                rows.append([
                    (f"{count} concurrent" if count > 1 else "1") + (f" (x{len(group)} runs)" if len(group) > 1 else ""),
                    len(values),
                    ms(latency[count]["p50"]),
                    ms(latency[count]["p95"]),
                    ms(ready_all),
                    f"{ready_all / one:.2f}x",
                    f"{latency[count]['p50'] / bare:.2f}x",
                    f"{latency[count]['p50'] / bare_qemu:.2f}x",
                ])
            results["fork_latency"] = {str(k): v for k, v in latency.items()}
            report.table(
                f"Fork latency: fork() until the fork's agent answers ({SOURCE_MIB} MiB source)",
                ["forks", "samples", "p50", "p95", "all ready", "all ready / 1-fork p50", "p50 / bare start",
                 "p50 / QEMU alone"],
                rows,
            )

            phase_cols = {c: _median_phases([f["phases"] for r in g for f in r["forks"]], FORK_PHASES)
                          for c, g in rounds.items()}
            results["fork_phases_median_s"] = {str(k): v for k, v in phase_cols.items()}
            report.table(
                "Where fork time goes (median per fork of each stretch; concurrent forks overlap)",
                ["stretch", *(_plural(c) for c in rounds)],
                [[label, *(ms(phase_cols[c][label]) if label in phase_cols[c] else "-" for c in rounds)]
                 for label in FORK_PHASES if any(label in phase_cols[c] for c in rounds)]
                + [["total (p50 latency)", *(ms(latency[c]["p50"]) for c in rounds)]],
            )
            capture_cols = {c: _median_phases([r["capture_phases"] for r in g], CAPTURE_PHASES)
                            for c, g in rounds.items()}
            report.table(
                f"The source's capture ({SOURCE_MIB} MiB source; one capture per round; median)",
                ["stretch", *(_plural(c) for c in rounds)],
                [[label, *(ms(capture_cols[c][label]) if label in capture_cols[c] else "-" for c in rounds)]
                 for label in CAPTURE_PHASES]
                + [["captures per round", *(", ".join(str(r["captures"]) for r in rounds[c]) for c in rounds)],
                   ["every pause (ms)", *(", ".join(f"{p:.0f}" for r in rounds[c] for p in r["pause_ms"])
                                          for c in rounds)]],
            )
            timeline = singles[-1]["capture_timeline"]
            if timeline:
                report.table(
                    "One capture step by step (the last single fork's; QMP commands and runtime calls)",
                    ["at", "until", "who", "what"],
                    [[ms(t["at"]), ms(t["end"]), t["who"], t["what"] + (f" x{t['count']}" if t["count"] > 1 else "")]
                     for t in timeline],
                )
            shortened = [m for g in rounds.values() for r in g for m in r["runtime_log"] if "chain shortened" in m]
            if shortened:
                report.note(f"the runtime shortened the source's disk chain {len(shortened)} time(s) during the "
                            f"rounds: {shortened[0]}")

            # memory and bytes per fork
            mem_rows, disk_rows = [], []
            pss_single = None
            for count, group in rounds.items():
                footprints = [r["footprint"] for r in group]
                forks = [f for fp in footprints for f in fp["forks"]]
                fork_pss = median([f["memory"]["Pss"] for f in forks])
                source_pss = median([fp["source_memory"]["Pss"] for fp in footprints])
                if count == 1:
                    pss_single = (fork_pss, source_pss)

                def parts(memory_list):
                    return " / ".join(mib(median([m.get(k, 0) for m in memory_list]))
                                      for k in ("Pss_Anon", "Pss_File", "Pss_Shmem"))

                mem_rows.append([
                    _plural(count),
                    mib(fork_pss),
                    parts([f["memory"] for f in forks]),
                    mib(source_pss),
                    parts([fp["source_memory"] for fp in footprints]),
                    f"{fork_pss / source_pss * 100:.0f} %",
                    f"{fork_pss / source_before['Pss'] * 100:.0f} %",
                ])
                disk_rows.append([
                    _plural(count),
                    mib(median([f["top_layer_bytes"] for f in forks])),
                    mib(median([f["capture_bytes"] for f in forks])),
                    str(median([f["capture_users"] for f in forks])),
                    mib(median([f["capture_share_bytes"] for f in forks])),
                    mib(median([f["top_layer_bytes"] + f["capture_share_bytes"] for f in forks])),
                ])
            report.table(
                f"Memory of an idle fork ({args.settle:.0f} s after ready): PSS of its QEMU (smaps_rollup); "
                f"source before any fork: PSS {mib(source_before['Pss'])}",
                ["round", "fork PSS", "anon / file / shmem", "source PSS", "anon / file / shmem", "fork / source",
                 "fork / source before forks"],
                mem_rows,
            )
            report.table(
                "Bytes per fork: its top qcow2 layer + its share of the capture folder (RAM file + state, on tmpfs)",
                ["round", "top layer", "capture folder", "forks sharing it", "capture share", "total per fork"],
                disk_rows,
            )

            # -- pause -----------------------------------------------------------------
            await bench.delete(source)  # the pause sources get the CPU to themselves
            pauses = {}
            for memory_mib, fill_mib in pause_sizes:
                pauses[memory_mib] = await fb.pause_series(memory_mib, fill_mib, pause_runs)
            results["pause"] = {str(k): v for k, v in pauses.items()}
            pause_rows = []
            for memory_mib, series in pauses.items():
                samples = series["samples"]
                phases = _median_phases([s["capture_phases"] for s in samples], CAPTURE_PHASES)
                calibration = series["stop_500ms_seen_by_guest_ms"]
                pause_rows.append([
                    f"{memory_mib} MiB, {series['filled_mib']} MiB held (guest uses {series['guest_used_mib']} MiB)",
                    f"{series['pause_ms']['p50']:.0f} ms",
                    ", ".join(f"{s['pause_ms']:.0f}" for s in samples),
                    ms(phases.get("capture total", float("nan"))),
                    ms(median([s["fork_latency_s"] for s in samples])),
                    mib(median([s["capture_ram_bytes"] for s in samples])),
                    (f"{median([s['guest_gap_monotonic_ms'] for s in samples]):.0f} / "
                     f"{median([s['guest_gap_wall_ms'] for s in samples]):.0f} ms"),
                    f"{median(series['noise_gap_monotonic_ms']):.0f} / {median(series['noise_gap_wall_ms']):.0f} ms",
                    f"{calibration[0]:.0f} / {calibration[1]:.0f} ms" if calibration else "-",
                ])
            report.table(
                "Source pause per capture (vCPUs stopped, from the runtime's log); guest columns: biggest gap "
                f"between 1 ms sleeps (monotonic / wall), {GAP_MS} ms and up",
                ["source", "pause p50", "all (ms)", "capture total", "fork ready", "capture RAM file",
                 "guest saw", "guest noise, no fork", "guest saw a 500 ms stop as"],
                pause_rows,
            )

        # -- targets -------------------------------------------------------------------
        report.target(
            "fork p50 <= 1.5x bare QEMU start",
            f"{ms(one)} vs {ms(bare)} = {one / bare:.2f}x (vs QEMU alone {ms(bare_qemu)}: {one / bare_qemu:.2f}x)",
            "<= 1.50x", one / bare <= 1.5,
        )
        for count in counts:
            if count in rounds:
                ratio = latency[count]["all_ready"] / one
                report.target(f"{count} concurrent all ready <= 3x one fork",
                              f"{ms(latency[count]['all_ready'])} / {ms(one)} = {ratio:.2f}x", "<= 3.00x", ratio <= 3)
        if 32 not in rounds:
            report.target("32 concurrent all ready <= 3x one fork", "not run", "<= 3.00x", None)
        for memory_mib, series in pauses.items():
            p50 = series["pause_ms"]["p50"]
            report.target(f"source pause p50 <= 100 ms ({memory_mib} MiB)", f"{p50:.0f} ms", "<= 100 ms", p50 <= 100)
        if 256 in pauses and 1024 in pauses:
            a, b = pauses[256]["pause_ms"]["p50"], pauses[1024]["pause_ms"]["p50"]
            report.target("pause about equal: 1 GiB / 256 MiB", f"{b:.0f} / {a:.0f} ms = {b / a:.2f}x",
                          "<= 1.50x", b / a <= 1.5)
        else:
            report.target("pause about equal: 1 GiB / 256 MiB", "not run (--quick)", "<= 1.50x", None)
        if pss_single:
            fork_pss, source_pss = pss_single
            report.target("idle fork PSS <= 25 % of the source's (1 fork)",
                          f"{mib(fork_pss)} / {mib(source_pss)} = {fork_pss / source_pss * 100:.0f} % "
                          f"({fork_pss / source_before['Pss'] * 100:.0f} % of the source before forks)",
                          "<= 25 %", fork_pss / source_pss <= 0.25)
        speedup = boot_warm / one
        report.target("fork >= 20x faster than boot + warm-up", f"{ms(boot_warm)} / {ms(one)} = {speedup:.1f}x",
                      ">= 20x", speedup >= 20)
        report.print_targets()
    report.write_json(args.json)


if __name__ == "__main__":
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="1 and 4 forks, 256 MiB pause only, fewer repetitions")
    parser.add_argument("--single-runs", type=int, help="single forks to time (default 5, quick 3)")
    parser.add_argument("--pause-runs", type=int, help="captures per pause size (default 5, quick 3)")
    parser.add_argument("--concurrent", type=int, nargs="+", metavar="N",
                        help="concurrent fork counts to time (default 8 32, quick 4), e.g. --concurrent 50")
    parser.add_argument("--settle", type=float, default=5.0, help="seconds forks idle before PSS is read (default 5)")
    arguments = parser.parse_args()
    raise SystemExit(run(lambda: main(arguments)))
