"""Forks of a running machine: latency, source pause, memory and disk per fork, baselines.

    python bench/fork.py [--json out.json] [--quick]

All in one run, so that every ratio compares numbers measured on the same machine at
about the same time:

- baselines: a bare QEMU start (the runtime's own command line with ``-incoming``, until
  its QMP socket answers ``query-status``) and a fresh boot plus a warm-up command;
- fork latency (``fork`` called until the fork's agent answers) for 1 fork at a time
  and for 8 and 32 concurrent forks of one 512 MiB source, with where the time goes;
- the source's pause (from the runtime's ``capture taken ... pause_ms=`` log line) for a
  256 MiB and a 1 GiB source whose memory is partly filled, and what the guest noticed;
- PSS of each idle fork's QEMU against the source's, and its disk bytes.

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
from typing import Any

import boxd.runtime.local as local_module
from boxd.runtime.agent_client import AgentClient
from boxd.runtime.qemu import Launch, Monitor, create_overlay, kill_qemu, start_qemu

from _common import (
    MiB,
    Bench,
    LogCapture,
    Report,
    allocated_bytes,
    base_parser,
    bench_image,
    console,
    host_facts,
    mem_available,
    median,
    mib,
    ms,
    percentile,
    run,
    smaps_rollup,
    summary,
)

WARM_UP = ["python3", "-c", "import json, hashlib, sqlite3, email, http.client"]

# Records every gap of over 20 ms between 1 ms sleeps, as seen by the guest's own
# monotonic and wall clocks, after filling (and holding) some memory with random bytes.
FILLER = r"""
import os, sys, time
size = int(sys.argv[1]) << 20
held = bytearray(size)
chunk = os.urandom(16 << 20)
for offset in range(0, size, len(chunk)):
    piece = chunk[: size - offset]
    held[offset : offset + len(piece)] = piece
open("/tmp/filled", "w").close()
out = open("/tmp/gaps", "a", buffering=1)
mono, wall = time.monotonic(), time.time()
while True:
    time.sleep(0.001)
    m, w = time.monotonic(), time.time()
    if m - mono > 0.02 or w - wall > 0.02:
        out.write(f"{(m - mono) * 1000:.1f} {(w - wall) * 1000:.1f}\n")
    mono, wall = m, w
"""

# (label, from mark, to mark): consecutive stretches of one fork's life, measured from
# outside the runtime by wrapping the functions it calls (see Tracer).
FORK_PHASES = [
    ("wait for capture", "call", "capture_end"),
    ("load image (sync), prepare", "capture_end", "overlay_begin"),
    ("qcow2 overlay (qemu-img)", "overlay_begin", "overlay_end"),
    ("QEMU start (-daemonize)", "overlay_end", "qemu_end"),
    ("QMP connect", "qemu_end", "qmp_end"),
    ("state load (migrate-incoming)", "qmp_end", "incoming_end"),
    ("cont, fork() returns", "incoming_end", "returned"),
    ("agent answers ping", "returned", "ping_end"),
    ("set guest clock", "ping_end", "ready"),
]
CAPTURE_PHASES = [
    ("stop (QMP)", "capture_begin", "freeze_disk_begin"),
    ("disk snapshot", "freeze_disk_begin", "freeze_disk_end"),
    ("device state (migrate)", "freeze_disk_end", "freeze_ram_begin"),
    ("RAM copy (cp)", "freeze_ram_begin", "freeze_ram_end"),
    ("cont (QMP)", "freeze_ram_end", "capture_end"),
]


class Tracer:
    """Timestamps of what the runtime does, taken by wrapping the functions it calls.

    Only the bench's own process is patched, and only for the run; the runtime's code is
    not changed. ``marks[key][name]`` is the last time ``name`` happened for ``key`` (a
    machine id).
    """

    def __init__(self, runtime: local_module.LocalRuntime) -> None:
        self.runtime = runtime
        self.marks: dict[str, dict[str, float]] = collections.defaultdict(dict)
        self._undo: list[tuple[Any, str, Any, bool]] = []

    def mark(self, key: str, name: str) -> None:
        self.marks[key][name] = time.monotonic()

    def _wrap(self, owner: Any, attr: str, label: str, key_of, instance: bool = False) -> None:
        original = getattr(owner, attr)

        async def wrapper(*args: Any, **kwargs: Any) -> Any:
            key = key_of(*args, **kwargs)
            self.mark(key, f"{label}_begin")
            try:
                return await original(*args, **kwargs)
            finally:
                self.mark(key, f"{label}_end")

        setattr(owner, attr, wrapper)
        self._undo.append((owner, attr, original, instance))

    def __enter__(self) -> "Tracer":
        rt, mod = self.runtime, local_module
        self._wrap(mod, "create_overlay", "overlay", lambda path, *a, **k: Path(path).name.rsplit("-", 1)[0])
        self._wrap(mod, "start_qemu", "qemu", lambda launch, *a, **k: launch.name)
        self._wrap(mod, "wait_incoming", "incoming", lambda monitor, *a, **k: monitor.name)
        self._wrap(mod, "wait_migration", "migration", lambda monitor, *a, **k: monitor.name)
        self._wrap(rt, "_monitor", "qmp", lambda vm_id, *a, **k: vm_id, instance=True)
        self._wrap(rt, "_capture", "capture", lambda source, *a, **k: source.id, instance=True)
        self._wrap(rt, "_freeze_disk", "freeze_disk", lambda source, *a, **k: source.id, instance=True)
        self._wrap(rt, "_freeze_ram", "freeze_ram", lambda source, *a, **k: source.id, instance=True)
        self._wrap(AgentClient, "connect", "ping", lambda client, *a, **k: client.name)
        return self

    def __exit__(self, *exc_info: object) -> None:
        for owner, attr, original, instance in reversed(self._undo):
            if instance:
                delattr(owner, attr)
            else:
                setattr(owner, attr, original)

    def phases(self, vm_id: str, source_id: str, spec=FORK_PHASES) -> dict[str, float]:
        marks = dict(self.marks.get(vm_id, {}))
        source = self.marks.get(source_id, {})
        for name in ("capture_begin", "capture_end", "freeze_disk_begin", "freeze_disk_end",
                     "freeze_ram_begin", "freeze_ram_end"):
            if name in source and name not in marks:
                marks[name] = source[name]
        return {label: marks[b] - marks[a] for label, a, b in spec if a in marks and b in marks}


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
        """The runtime's command line with -incoming, until QMP answers query-status."""
        runtime, image = self.runtime, self.bench.image
        name = f"bare{self.tag}-{index}"
        run_dir = runtime.shm_dir / name  # under shm_dir: the bench's final sweep kills it
        run_dir.mkdir(parents=True)
        ram = run_dir / "ram"
        with open(ram, "wb") as handle:
            handle.truncate(memory_mib * MiB)
        disk = runtime.layers_dir / f"{name}.qcow2"
        await create_overlay(disk, image.rootfs)
        launch = Launch(
            name=name, run_dir=run_dir, ram_file=ram, ram_shared=False, disk=disk,
            kernel=image.kernel, initrd=image.initrd, console_log=run_dir / "console.log",
            accelerator=runtime.accelerator, vcpus=1, memory_mib=memory_mib, isolated=False, incoming=True,
        )
        monitor = Monitor(launch.qmp_socket, name)
        pid = None
        try:
            started = time.monotonic()
            pid = await start_qemu(launch)
            launched = time.monotonic()
            await monitor.connect()
            status = await monitor.execute("query-status")
            answered = time.monotonic()
            if status.get("status") != "inmigrate":
                console.print(f"[yellow]bare QEMU status {status}[/yellow]")
        finally:
            await monitor.close()
            await kill_qemu(pid, str(run_dir) + "/")
            shutil.rmtree(run_dir, ignore_errors=True)
            disk.unlink(missing_ok=True)
        return {"total_s": answered - started, "launch_s": launched - started, "qmp_s": answered - launched}

    # -- forks ----------------------------------------------------------------------------

    async def fork_round(self, source: str, count: int) -> dict[str, Any]:
        """``count`` concurrent fork calls of one id each, each followed by wait_ready."""
        self.rounds += 1
        ids = [self.bench.track(f"f{self.tag}-{self.rounds}-{n}") for n in range(count)]
        self.tracer.marks.pop(source, None)
        pauses_before = len(self.logs.records)

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
            fork["phases"] = self.tracer.phases(fork["id"], source)
        captures = [
            r.getMessage() for r in self.logs.records[pauses_before:]
            if "capture taken" in r.getMessage() and f"source={source} " in r.getMessage()
        ]
        capture = self.tracer.phases(source, source, CAPTURE_PHASES)
        return {
            "count": count,
            "ids": ids,
            "forks": forks,
            "all_ready_s": all_ready,
            "captures": len(captures),
            "pause_ms": [float(m.rsplit("pause_ms=", 1)[1]) for m in captures],
            "capture_phases": capture,
        }

    async def footprint(self, source: str, source_pid: int, round_: dict[str, Any]) -> dict[str, Any]:
        """PSS of each idle fork's QEMU and of the source's; disk bytes per fork."""
        await asyncio.sleep(self.args.settle)
        runtime = self.runtime
        source_mem = smaps_rollup(source_pid)
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
        return {"source_memory": source_mem, "forks": per_fork}

    async def delete_round(self, round_: dict[str, Any]) -> None:
        for vm_id in round_["ids"]:
            await self.bench.delete(vm_id)

    # -- pause ----------------------------------------------------------------------------

    async def pause_series(self, memory_mib: int, fill_mib: int, runs: int) -> dict[str, Any]:
        bench, runtime = self.bench, self.runtime
        source = f"p{self.tag}-{memory_mib}"
        with console.status(f"pause: booting a {memory_mib} MiB source"):
            await bench.boot(source, memory_mib=memory_mib)
            await runtime.write_file(source, "/tmp/filler.py", _one(FILLER.encode()))
            await bench.sh(source, f"nohup python3 /tmp/filler.py {fill_mib} >/tmp/filler.log 2>&1 &")
            deadline = time.monotonic() + 600
            while await bench.sh(source, "test -e /tmp/filled && echo yes || echo no") != "yes":
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{source}: filling {fill_mib} MiB took over 10 min")
                if await bench.sh(source, "pgrep -f filler.py >/dev/null && echo up || echo down") == "down":
                    raise RuntimeError(f"{source}: filler died: {await bench.sh(source, 'cat /tmp/filler.log')}")
                await asyncio.sleep(1)
        guest_used = await bench.sh(source, "free -m | awk '/Mem:/ {print $3}'")

        async def gaps() -> tuple[float, float]:
            text = await bench.sh(source, "cat /tmp/gaps; : > /tmp/gaps")
            rows = [tuple(map(float, line.split())) for line in text.splitlines() if line.strip()]
            return (max((r[0] for r in rows), default=0.0), max((r[1] for r in rows), default=0.0))

        samples = []
        noise = []
        for index in range(runs):
            # The guest's own noise floor: the same reads, but no fork in between.
            await gaps()
            await asyncio.sleep(2.0)
            noise.append(await gaps())
            with console.status(f"pause {memory_mib} MiB: fork {index + 1}/{runs}"):
                round_ = await self.fork_round(source, 1)
                await asyncio.sleep(0.5)
                seen = await gaps()
                fork_id = round_["ids"][0]
                capture = bench.machine_record(fork_id)["ram_capture"]
                ram_bytes = allocated_bytes(runtime.captures_dir / capture / "ram")
                await self.delete_round(round_)
            sample = {
                "pause_ms": round_["pause_ms"][0] if round_["pause_ms"] else None,
                "capture_phases": round_["capture_phases"],
                "capture_ram_bytes": ram_bytes,
                "guest_gap_monotonic_ms": seen[0],
                "guest_gap_wall_ms": seen[1],
                "fork_latency_s": round_["forks"][0]["latency_s"],
            }
            samples.append(sample)
            console.print(
                f"pause {memory_mib} MiB #{index + 1}: {sample['pause_ms']:.0f} ms "
                f"(RAM copy {mib(ram_bytes)}; guest saw {seen[0]:.0f} ms monotonic / {seen[1]:.0f} ms wall, "
                f"noise {noise[-1][0]:.0f} / {noise[-1][1]:.0f} ms)"
            )
        await bench.delete(source)
        return {
            "memory_mib": memory_mib,
            "filled_mib": fill_mib,
            "guest_used_mib": int(guest_used) if guest_used.isdigit() else guest_used,
            "samples": samples,
            "noise_gap_monotonic_ms": [n[0] for n in noise],
            "noise_gap_wall_ms": [n[1] for n in noise],
            "pause_ms": summary([s["pause_ms"] for s in samples if s["pause_ms"] is not None]),
        }


async def _one(data: bytes):
    yield data


def _median_phases(forks: list[dict[str, Any]], spec) -> dict[str, float]:
    out = {}
    for label, _, _ in spec:
        values = [f["phases"][label] for f in forks if label in f["phases"]]
        if values:
            out[label] = median(values)
    return out


async def main(args) -> None:
    quick = args.quick
    single_runs = args.single_runs or (3 if quick else 5)
    counts = [4] if quick else [8, 32]
    pause_sizes = [(256, 150)] if quick else [(256, 150), (1024, 700)]
    pause_runs = args.pause_runs or (3 if quick else 5)
    boot_runs = 1 if quick else 3
    bare_runs = 3 if quick else 5
    source_mib = 512

    report = Report("fork", vars(args) | {"json": str(args.json) if args.json else None})
    image = bench_image()
    async with Bench(image, keep_home=args.keep_home) as bench:
        runtime = bench.runtime
        report.host = host_facts(runtime)
        with LogCapture("boxd.runtime.local") as logs, Tracer(runtime) as tracer:
            fb = ForkBench(bench, report, tracer, logs, args)
            results = report.results

            # -- baseline: boot + warm-up; the last machine booted is the forks' source --
            boots = []
            for index in range(boot_runs):
                vm_id = f"s{fb.tag}-{index}"
                with console.status(f"baseline: boot + warm-up {index + 1}/{boot_runs}"):
                    boots.append(await fb.boot_and_warm(vm_id, source_mib))
                console.print(
                    f"boot + warm-up {index + 1}: {ms(boots[-1]['total_s'])} "
                    f"(boot {ms(boots[-1]['ready_s'])}, warm-up {ms(boots[-1]['warm_up_s'])})"
                )
                if index < boot_runs - 1:
                    await bench.delete(vm_id)
            source = f"s{fb.tag}-{boot_runs - 1}"
            source_pid = (await runtime.info(source)).pid
            results["boot_warm"] = {
                "total": summary([b["total_s"] for b in boots]),
                "boot_s": [b["ready_s"] for b in boots],
                "warm_up_s": [b["warm_up_s"] for b in boots],
            }

            # -- baseline: bare QEMU start (the source idles meanwhile, as during forks) --
            bares = []
            for index in range(bare_runs):
                with console.status(f"baseline: bare QEMU start {index + 1}/{bare_runs}"):
                    bares.append(await fb.bare_qemu_start(index, source_mib))
            results["bare_qemu"] = {
                "total": summary([b["total_s"] for b in bares]),
                "launch_s": [b["launch_s"] for b in bares],
                "qmp_s": [b["qmp_s"] for b in bares],
            }
            bare = median([b["total_s"] for b in bares])
            boot_warm = median([b["total_s"] for b in boots])
            report.table(
                "Baselines",
                ["baseline", "median", "all runs", "parts (median)"],
                [
                    [
                        f"bare QEMU start -> QMP query-status ({source_mib} MiB, -incoming)",
                        ms(bare),
                        ", ".join(ms(b["total_s"]) for b in bares),
                        f"launch {ms(median([b['launch_s'] for b in bares]))}, "
                        f"QMP {ms(median([b['qmp_s'] for b in bares]))}",
                    ],
                    [
                        "fresh boot + warm-up",
                        ms(boot_warm),
                        ", ".join(ms(b["total_s"]) for b in boots),
                        f"boot {ms(median([b['ready_s'] for b in boots]))}, "
                        f"warm-up {ms(median([b['warm_up_s'] for b in boots]))}",
                    ],
                ],
            )

            # -- fork latency --------------------------------------------------------------
            singles, single_prints = [], []
            for index in range(single_runs):
                with console.status(f"1 fork, run {index + 1}/{single_runs}"):
                    round_ = await fb.fork_round(source, 1)
                    round_["footprint"] = await fb.footprint(source, source_pid, round_)
                    await fb.delete_round(round_)
                singles.append(round_)
                single_prints.append(round_["forks"][0]["latency_s"])
                console.print(f"1 fork #{index + 1}: {ms(single_prints[-1])}")
            rounds = {1: singles}
            for count in counts:
                need = count * 160 * MiB + source_mib * MiB + 1024 * MiB
                if mem_available() < need:
                    report.note(f"{count} concurrent forks skipped: {mib(mem_available())} available, want {mib(need)}")
                    continue
                with console.status(f"{count} concurrent forks"):
                    round_ = await fb.fork_round(source, count)
                    round_["footprint"] = await fb.footprint(source, source_pid, round_)
                    await fb.delete_round(round_)
                rounds[count] = [round_]
                console.print(f"{count} concurrent forks: all ready in {ms(round_['all_ready_s'])}")
            results["fork_rounds"] = {str(k): v for k, v in rounds.items()}

            single_lat = [f["latency_s"] for r in singles for f in r["forks"]]
            one = percentile(single_lat, 50)
            rows = []
            latency: dict[int, dict[str, Any]] = {}
            for count, group in rounds.items():
                values = [f["latency_s"] for r in group for f in r["forks"]]
                ready_all = median([r["all_ready_s"] for r in group])
                latency[count] = {"p50": percentile(values, 50), "p95": percentile(values, 95), "all_ready": ready_all}
                rows.append(
                    [
                        f"{count} concurrent" + (f" (x{len(group)} runs)" if len(group) > 1 else ""),
                        len(values),
                        ms(latency[count]["p50"]),
                        ms(latency[count]["p95"]),
                        ms(ready_all),
                        f"{ready_all / one:.2f}x",
                        f"{latency[count]['p50'] / bare:.2f}x",
                    ]
                )
            results["fork_latency"] = {str(k): v for k, v in latency.items()}
            report.table(
                f"Fork latency: fork() until the fork's agent answers ({source_mib} MiB source)",
                ["forks", "samples", "p50", "p95", "all ready", "all ready / 1-fork p50", "p50 / bare QEMU"],
                rows,
            )

            # where the time goes
            phase_cols = {count: _median_phases([f for r in group for f in r["forks"]], FORK_PHASES)
                          for count, group in rounds.items()}
            results["fork_phases_median_s"] = {str(k): v for k, v in phase_cols.items()}
            report.table(
                "Where fork time goes (median per fork, wall time; concurrent forks overlap)",
                ["phase", *(f"{c} fork{'s' if c > 1 else ''}" for c in rounds)],
                [[label, *(ms(phase_cols[c].get(label, float("nan"))) for c in rounds)] for label, _, _ in FORK_PHASES]
                + [["total", *(ms(latency[c]["p50"]) for c in rounds)]],
            )
            capture_cols = {count: {label: median([r["capture_phases"].get(label, float("nan")) for r in group])
                                    for label, _, _ in CAPTURE_PHASES}
                            for count, group in rounds.items()}
            pause_cols = {count: median([p for r in group for p in r["pause_ms"]]) for count, group in rounds.items()}
            report.table(
                f"The source's capture ({source_mib} MiB, after warm-up; one capture per round, median)",
                ["step", *(f"{c} fork{'s' if c > 1 else ''}" for c in rounds)],
                [[label, *(ms(capture_cols[c][label]) for c in rounds)] for label, _, _ in CAPTURE_PHASES]
                + [["pause_ms (runtime log)", *(f"{pause_cols[c]:.0f} ms" for c in rounds)],
                   ["captures per round", *(str(median([r["captures"] for r in rounds[c]])) for c in rounds)]],
            )

            # memory and disk
            mem_rows, disk_rows = [], []
            pss_ratio_single = None
            for count, group in rounds.items():
                footprints = [r["footprint"] for r in group]
                forks = [f for fp in footprints for f in fp["forks"]]
                fork_pss = median([f["memory"]["Pss"] for f in forks])
                source_pss = median([fp["source_memory"]["Pss"] for fp in footprints])
                ratio = fork_pss / source_pss
                if count == 1:
                    pss_ratio_single = (fork_pss, source_pss, ratio)
                mem_rows.append(
                    [
                        f"{count} fork{'s' if count > 1 else ''}",
                        mib(fork_pss),
                        f"{mib(median([f['memory'].get('Pss_Anon', 0) for f in forks]))} / "
                        f"{mib(median([f['memory'].get('Pss_File', 0) for f in forks]))} / "
                        f"{mib(median([f['memory'].get('Pss_Shmem', 0) for f in forks]))}",
                        mib(median([f["memory"]["Rss"] for f in forks])),
                        mib(source_pss),
                        f"{ratio * 100:.0f} %",
                    ]
                )
                disk_rows.append(
                    [
                        f"{count} fork{'s' if count > 1 else ''}",
                        mib(median([f["top_layer_bytes"] for f in forks])),
                        mib(median([f["capture_bytes"] for f in forks])),
                        str(median([f["capture_users"] for f in forks])),
                        mib(median([f["capture_share_bytes"] for f in forks])),
                        mib(median([f["top_layer_bytes"] + f["capture_share_bytes"] for f in forks])),
                    ]
                )
            report.table(
                f"Memory of an idle fork ({args.settle:.0f} s after ready): PSS of its QEMU (smaps_rollup)",
                ["round", "fork PSS", "anon / file / shmem", "fork RSS", "source PSS", "fork / source"],
                mem_rows,
            )
            report.table(
                "Bytes per fork: its top qcow2 layer + its share of the capture folder (on tmpfs)",
                ["round", "top layer", "capture folder", "forks sharing it", "capture share", "total per fork"],
                disk_rows,
            )

            # -- pause ---------------------------------------------------------------------
            await bench.delete(source)  # the pause sources get the CPU to themselves
            pauses = {}
            for memory_mib, fill_mib in pause_sizes:
                pauses[memory_mib] = await fb.pause_series(memory_mib, fill_mib, pause_runs)
            results["pause"] = {str(k): v for k, v in pauses.items()}
            pause_rows = []
            for memory_mib, series in pauses.items():
                samples = series["samples"]
                pause_rows.append(
                    [
                        f"{memory_mib} MiB, {series['filled_mib']} MiB held (guest uses {series['guest_used_mib']} MiB)",
                        mib(median([s["capture_ram_bytes"] for s in samples])),
                        f"{series['pause_ms']['p50']:.0f} ms",
                        ", ".join(f"{s['pause_ms']:.0f}" for s in samples),
                        ms(median([s["capture_phases"].get("RAM copy (cp)", float("nan")) for s in samples])),
                        f"{median([s['guest_gap_monotonic_ms'] for s in samples]):.0f} / "
                        f"{median([s['guest_gap_wall_ms'] for s in samples]):.0f} ms",
                        f"{median(series['noise_gap_monotonic_ms']):.0f} / {median(series['noise_gap_wall_ms']):.0f} ms",
                    ]
                )
            report.table(
                "Source pause per capture (stop -> cont, from the runtime's log)",
                ["source", "RAM copied", "pause p50", "all (ms)", "of which RAM copy", "guest saw (mono / wall)",
                 "guest noise, no fork"],
                pause_rows,
            )

        # -- targets -------------------------------------------------------------------
        report.target("fork p50 <= 1.5x bare QEMU start", f"{ms(one)} vs {ms(bare)} = {one / bare:.2f}x", "<= 1.50x",
                      one / bare <= 1.5)
        big = max(c for c in rounds) if len(rounds) > 1 else None
        if big is not None:
            ratio = latency[big]["all_ready"] / one
            report.target(f"{big} concurrent all ready <= 3x one fork", f"{ms(latency[big]['all_ready'])} = {ratio:.2f}x",
                          "<= 3.00x", ratio <= 3)
        if 32 not in rounds:
            report.target("32 concurrent all ready <= 3x one fork", "not run", "<= 3.00x", None)
        for memory_mib, series in pauses.items():
            p50 = series["pause_ms"]["p50"]
            report.target(f"source pause p50 <= 100 ms ({memory_mib} MiB)", f"{p50:.0f} ms", "<= 100 ms", p50 <= 100)
        if 256 in pauses and 1024 in pauses:
            a, b = pauses[256]["pause_ms"]["p50"], pauses[1024]["pause_ms"]["p50"]
            report.target("pause about equal, 1 GiB / 256 MiB", f"{b:.0f} / {a:.0f} ms = {b / a:.2f}x",
                          "<= 1.50x", b / a <= 1.5)
        else:
            report.target("pause about equal, 1 GiB / 256 MiB", "not run (--quick)", "<= 1.50x", None)
        if pss_ratio_single:
            fork_pss, source_pss, ratio = pss_ratio_single
            report.target("idle fork PSS <= 25% of source (1 fork)", f"{mib(fork_pss)} / {mib(source_pss)} = {ratio * 100:.0f} %",
                          "<= 25 %", ratio <= 0.25)
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
    parser.add_argument("--settle", type=float, default=5.0, help="seconds forks idle before PSS is read (default 5)")
    arguments = parser.parse_args()
    raise SystemExit(run(lambda: main(arguments)))
