"""Idle machines: suspend and wake, hibernate and wake, and the memory hibernation frees.

    python bench/idle.py [--quick] [--runs 20] [--hibernations 5] [--json out.json]

All in one run, so that every ratio compares numbers measured on the same machine at
about the same time, on a 512 MiB machine in which a Python process holds 150 MiB of
random bytes and a random token that exists only in its memory:

- baseline: a fresh boot (``create`` until the agent answers), --hibernations times;
  the last machine booted becomes the one that is suspended and hibernated; and the
  round trip of ``exec true`` on it while it runs, --runs times;
- suspend: ``suspend()`` (QMP ``stop``) and, after --hold seconds, the wake:
  ``resume()`` until it returns (the vCPUs run again), with the QMP ``cont`` round trip
  inside it timed apart, and until an ``exec true`` started right after it answers;
  --runs cycles after one unrecorded one;
- hibernate: ``hibernate()`` (RAM and device state through zstd to
  ``vms/<id>/hibernation.zst``, QEMU ended, its RAM file on tmpfs removed) and the wake:
  ``resume()`` until the vCPUs run, and until ``wait_ready()`` returns (the agent
  answers), against the fresh boot; --hibernations cycles;
- memory: PSS of the machine's QEMU and passt and the blocks of its RAM file on tmpfs
  right before each hibernation, the same right after, and the size of hibernation.zst.

After every wake the token is read back from the process and compared with the one it
held before (mismatches are counted); after every wake from hibernation the CRC-32 of
the held bytes is compared too.

``--quick``: 5 suspend cycles and 3 hibernations (a smoke run of a couple of minutes).
"""

from __future__ import annotations

import asyncio
import time
from typing import Any, Self

from boxd.runtime.interface import VMState
from boxd.runtime.local import LocalRuntime
from boxd.runtime.qemu import Monitor, process_alive, read_pid

from _common import (
    ROTATE,
    Bench,
    HolderBench,
    MiB,
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

MEMORY_MIB = 512
READY_TIMEOUT = 180


class Calls:
    """What the runtime does inside the calls timed, timed from outside it.

    ``Monitor.execute`` (every QMP command) and the runtime's ``_save`` (the write of a
    machine.json) are wrapped in the bench's own process for the run, one more function
    call each (a microsecond or two); the runtime's code is not changed. ``events`` holds
    (begin, end, machine, what), by ``time.perf_counter``; ``what`` is the QMP command or
    "machine.json".
    """

    def __init__(self, runtime: LocalRuntime) -> None:
        self.runtime = runtime
        self.events: list[tuple[float, float, str, str]] = []

    def __enter__(self) -> Self:
        events = self.events
        execute = self._execute = Monitor.execute
        save = self.runtime._save

        async def timed_execute(monitor: Monitor, command: str, arguments: dict[str, Any] | None = None) -> Any:
            begin = time.perf_counter()
            try:
                return await execute(monitor, command, arguments)
            finally:
                events.append((begin, time.perf_counter(), monitor.name, command))

        def timed_save(machine: Any) -> None:
            begin = time.perf_counter()
            try:
                save(machine)
            finally:
                events.append((begin, time.perf_counter(), machine.id, "machine.json"))

        Monitor.execute = timed_execute  # type: ignore[method-assign]
        self.runtime._save = timed_save  # type: ignore[method-assign]
        return self

    def __exit__(self, *exc_info: object) -> None:
        Monitor.execute = self._execute  # type: ignore[method-assign]
        del self.runtime._save

    def between(self, vm_id: str, begin: float, end: float) -> list[tuple[float, float, str, str]]:
        return [e for e in self.events if e[2] == vm_id and begin <= e[0] <= end]

    def took(self, vm_id: str, begin: float, end: float, what: str) -> float | None:
        """How long the last ``what`` between ``begin`` and ``end`` took."""
        found = [e for e in self.between(vm_id, begin, end) if e[3] == what]
        return found[-1][1] - found[-1][0] if found else None


def fine(seconds: float | None) -> str:
    """A duration short or long: µs under a millisecond, ms with decimals under 100 ms."""
    if seconds is None or seconds != seconds:
        return "-"
    if seconds < 1e-3:
        return f"{seconds * 1e6:.0f} µs"
    if seconds < 0.1:
        return f"{seconds * 1e3:.2f} ms"
    return ms(seconds)


class IdleBench(HolderBench):
    def __init__(self, bench: Bench, calls: Calls) -> None:
        super().__init__(bench)
        self.calls = calls

    async def vcpu_status(self, vm_id: str) -> str:
        """QEMU's own run state (``query-status``), asked outside any timed stretch."""
        return (await (await self.runtime._monitor(vm_id)).execute("query-status"))["status"]

    async def exec_true(self, vm_id: str) -> None:
        code = await self.bench.argv(vm_id, ["true"])
        if code != 0:
            raise RuntimeError(f"{vm_id}: true exited {code}")

    def host_memory(self, vm_id: str, qemu_pid: int | None) -> dict[str, Any]:
        """What the machine holds on the host: its QEMU's and passt's PSS and the blocks of
        its run folder on tmpfs (the RAM file, sockets, pidfiles). A process that is gone
        counts 0, a file that is gone 0."""
        runtime = self.runtime
        run_dir = runtime._run_dir(vm_id)
        marker = str(run_dir) + "/"
        qemu = smaps_rollup(qemu_pid) if process_alive(qemu_pid, marker) else {}
        passt_pid = read_pid(run_dir / "passt.pid")
        passt = smaps_rollup(passt_pid) if process_alive(passt_pid, marker) else {}
        ram_file = run_dir / "ram"
        ram_bytes = allocated_bytes(ram_file) if ram_file.exists() else 0
        run_dir_bytes = allocated_bytes(run_dir) if run_dir.exists() else 0
        # The RAM file's pages are in QEMU's Pss_Shmem (it maps the file) and in the file's
        # blocks: count them once, as the file's blocks (they stay on tmpfs unmapped too).
        held = qemu.get("Pss", 0) - qemu.get("Pss_Shmem", 0) + passt.get("Pss", 0) + run_dir_bytes
        return {
            "qemu_alive": bool(qemu),
            "qemu": qemu,
            "passt_alive": bool(passt),
            "passt": passt,
            "ram_file_exists": ram_file.exists(),
            "ram_file_bytes": ram_bytes,
            "run_dir_bytes": run_dir_bytes,
            "held_bytes": held,
        }

    # -- suspended ----------------------------------------------------------------------

    async def suspend_cycle(self, vm_id: str, expected: str, hold: float) -> dict[str, Any]:
        """suspend(), --hold seconds stopped, resume() and an exec of ``true`` right after."""
        runtime = self.runtime
        await self.settle(0.2)
        started = time.perf_counter()
        await runtime.suspend(vm_id)
        suspended = time.perf_counter()
        state_suspended = (await runtime.info(vm_id)).state
        status_suspended = await self.vcpu_status(vm_id)
        await asyncio.sleep(hold)
        woke = time.perf_counter()
        await runtime.resume(vm_id)
        running = time.perf_counter()
        await self.exec_true(vm_id)
        answered = time.perf_counter()
        status_after = await self.vcpu_status(vm_id)
        state_after = (await runtime.info(vm_id)).state
        token = await self.token(vm_id)
        stop = self.calls.took(vm_id, started, suspended, "stop")
        stop_save = self.calls.took(vm_id, started, suspended, "machine.json")
        cont = self.calls.took(vm_id, woke, running, "cont")
        cont_save = self.calls.took(vm_id, woke, running, "machine.json")
        return {
            "suspend_s": suspended - started,
            "qmp_stop_s": stop,
            "suspend_save_s": stop_save,
            "suspend_rest_s": (suspended - started) - stop - stop_save if stop is not None and stop_save is not None else None,
            "resume_s": running - woke,
            "qmp_cont_s": cont,
            "resume_save_s": cont_save,
            "resume_rest_s": (running - woke) - cont - cont_save if cont is not None and cont_save is not None else None,
            "agent_s": answered - woke,
            "state_suspended": state_suspended.value,
            "vcpus_suspended": status_suspended,
            "state_after": state_after.value,
            "vcpus_after": status_after,
            "paused_then_running": (state_suspended == VMState.PAUSED and status_suspended == "paused"
                                    and state_after == VMState.RUNNING and status_after == "running"),
            "token": token,
            "token_matches": token == expected,
        }

    # -- hibernated ----------------------------------------------------------------------

    async def hibernate_cycle(self, vm_id: str, crc_expected: str) -> dict[str, Any]:
        """A new token, the machine's memory on the host, hibernate(), the memory again and
        the file; then resume() and wait_ready(), and the token and CRC read back."""
        runtime, bench = self.runtime, self.bench
        await bench.sh(vm_id, ROTATE)
        expected = await self.token(vm_id)
        await self.settle(0.5)
        pid = (await runtime.info(vm_id)).pid
        before = self.host_memory(vm_id, pid)
        available_before = mem_available()

        started = time.perf_counter()
        await runtime.hibernate(vm_id)
        hibernated = time.perf_counter()
        info = await runtime.info(vm_id)
        after = self.host_memory(vm_id, pid)
        saved = runtime.vms_dir / vm_id / "hibernation.zst"
        file_size = saved.stat().st_size if saved.exists() else 0
        file_blocks = allocated_bytes(saved) if saved.exists() else 0
        await asyncio.sleep(0.5)
        available_after = mem_available()

        woke = time.perf_counter()
        await runtime.resume(vm_id)
        running = time.perf_counter()
        await runtime.wait_ready(vm_id, READY_TIMEOUT)
        ready = time.perf_counter()
        status_after = await self.vcpu_status(vm_id)
        state_after = (await runtime.info(vm_id)).state
        token = await self.token(vm_id)
        crc = await self.crc(vm_id)

        saving = [e for e in self.calls.between(vm_id, started, hibernated) if e[3] != "machine.json"]
        stop = next((e for e in saving if e[3] == "stop"), None)
        hibernate_phases = {}
        if stop is not None and saving:
            hibernate_phases = {
                "stop": stop[1] - started,
                "save (migrate until completed)": saving[-1][1] - stop[1],
                "fsync, QEMU ended, run folder removed": hibernated - saving[-1][1],
            }
        loading = self.calls.between(vm_id, woke, running)
        incoming = next((e for e in loading if e[3] == "migrate-incoming"), None)
        cont = next((e for e in loading if e[3] == "cont"), None)
        wake_phases = {}
        if incoming is not None and cont is not None:
            wake_phases = {
                "passt + QEMU start, QMP connect": incoming[0] - woke,
                "state load (migrate-incoming until paused)": cont[0] - incoming[0],
                "QMP cont": cont[1] - cont[0],
                "rest (machine.json, file removed)": running - cont[1],
            }
        return {
            "hibernate_s": hibernated - started,
            "hibernate_phases": hibernate_phases,
            "resume_s": running - woke,
            "ready_s": ready - woke,
            "wake_phases": wake_phases,
            "state_hibernated": info.state.value,
            "pid_hibernated": info.pid,
            "memory_before": before,
            "memory_after": after,
            "freed_bytes": before["held_bytes"] - after["held_bytes"],
            "all_freed": not after["qemu_alive"] and not after["passt_alive"] and not after["ram_file_exists"]
            and after["held_bytes"] == 0,
            "mem_available_before": available_before,
            "mem_available_after": available_after,
            "file_bytes": file_size,
            "file_allocated_bytes": file_blocks,
            "file_gone_after_wake": not saved.exists(),
            "state_after": state_after.value,
            "vcpus_after": status_after,
            "token_expected": expected,
            "token": token,
            "token_matches": token == expected and len(expected) == 32,
            "crc": crc,
            "crc_matches": crc == crc_expected,
        }


def _x(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x"


def _row(label: str, values: list[float], fmt=fine, extra: list[str] | None = None) -> list[str]:
    return [label, fmt(percentile(values, 50)), fmt(percentile(values, 95)),
            fmt(min(values) if values else None), fmt(max(values) if values else None), *(extra or [])]


async def main(args) -> None:
    runs = args.runs or (5 if args.quick else 20)
    hibernations = args.hibernations or (3 if args.quick else 5)
    fill_mib = args.fill
    report = Report("idle", vars(args) | {"json": str(args.json) if args.json else None, "runs": runs,
                                          "hibernations": hibernations})
    image = bench_image()
    async with Bench(image, keep_home=args.keep_home) as bench:
        runtime = bench.runtime
        report.host = host_facts(runtime)
        results = report.results
        with Calls(runtime) as calls:
            ib = IdleBench(bench, calls)

            # -- baseline: fresh boots; the last one stays and idles ---------------------
            vm, boot_values = await ib.fresh_boots(report, "i", hibernations, MEMORY_MIB, READY_TIMEOUT)
            boot = median(boot_values)

            # -- the machine: a process holds random bytes and a token -------------------
            with console.status(f"{vm}: a process fills and holds {fill_mib} MiB of random bytes"):
                await ib.start_holder(vm, fill_mib)
            guest = await ib.guest_memory(vm)
            token = await ib.token(vm)
            if len(token) != 32:
                raise RuntimeError(f"{vm}: the holder gave {token!r} as its token")
            with console.status(f"{vm}: CRC-32 of the held bytes"):
                crc = await ib.crc(vm)
            if len(crc) != 8:
                raise RuntimeError(f"{vm}: the holder gave {crc!r} as its CRC")
            results["guest_memory_bytes"] = guest
            results["held_crc32"] = crc
            console.print(f"{vm}: holder up; guest RAM {mib(guest['total'])} as its kernel sees it, "
                          f"used {mib(guest['used'])}; CRC-32 of the held bytes {crc}")

            # exec round trip on the running machine: the floor of "agent answers".
            for _ in range(3):
                await ib.exec_true(vm)
            trips = []
            with console.status(f"{runs} x exec true"):
                for _ in range(runs):
                    started = time.perf_counter()
                    await ib.exec_true(vm)
                    trips.append(time.perf_counter() - started)
            results["exec_true_running_s"] = summary(trips)
            # QMP round trip of a command that changes nothing: the floor of "cont" and "stop".
            monitor = await runtime._monitor(vm)
            queries = []
            for _ in range(runs + 3):
                started = time.perf_counter()
                await monitor.execute("query-status")
                queries.append(time.perf_counter() - started)
            queries = queries[3:]
            results["qmp_query_status_running_s"] = summary(queries)

            # -- suspend and wake ------------------------------------------------------
            # One unrecorded cycle first (the QMP connection was opened just above, and is
            # kept by the runtime).
            warm_up = await ib.suspend_cycle(vm, token, args.hold)
            results["suspend_warm_up"] = warm_up
            console.print(f"suspend warm-up (unrecorded): suspend {fine(warm_up['suspend_s'])}, "
                          f"resume {fine(warm_up['resume_s'])}")
            cycles = []
            with console.status(f"{runs} x suspend, {args.hold:g} s stopped, resume"):
                for index in range(runs):
                    cycles.append(await ib.suspend_cycle(vm, token, args.hold))
                    c = cycles[-1]
                    console.print(
                        f"suspend {index + 1}: suspend() {fine(c['suspend_s'])}, resume() {fine(c['resume_s'])} "
                        f"(QMP cont {fine(c['qmp_cont_s'])}), agent answered after {fine(c['agent_s'])}; "
                        f"token {'same' if c['token_matches'] else 'MISMATCH: ' + c['token']}"
                    )

            def col(key: str, samples: list[dict[str, Any]]) -> list[float]:
                return [s[key] for s in samples if s.get(key) is not None]

            resume_values = col("resume_s", cycles)
            resume_p50 = percentile(resume_values, 50)
            suspend_mismatches = sum(not c["token_matches"] for c in cycles)
            not_paused_running = sum(not c["paused_then_running"] for c in cycles)
            results["suspend"] = {
                "suspend_s": summary(col("suspend_s", cycles)),
                "qmp_stop_s": summary(col("qmp_stop_s", cycles)),
                "save_s": summary(col("suspend_save_s", cycles)),
                "rest_s": summary(col("suspend_rest_s", cycles)),
            }
            results["wake_suspended"] = {
                "hold_s": args.hold,
                "resume_s": summary(resume_values),
                "qmp_cont_s": summary(col("qmp_cont_s", cycles)),
                "save_s": summary(col("resume_save_s", cycles)),
                "rest_s": summary(col("resume_rest_s", cycles)),
                "agent_s": summary(col("agent_s", cycles)),
                "token_mismatches": suspend_mismatches,
                "not_paused_then_running": not_paused_running,
                "samples": cycles,
            }
            report.table(
                f"Suspend and wake: {runs} cycles of suspend(), {args.hold:g} s stopped, resume() "
                f"({MEMORY_MIB} MiB machine holding {fill_mib} MiB of random bytes, guest uses {mib(guest['used'])})",
                ["metric", "p50", "p95", "min", "max"],
                [
                    _row("wake: resume() until it returns (vCPUs run)", resume_values),
                    _row("  of which QMP cont round trip", col("qmp_cont_s", cycles)),
                    _row("  of which machine.json written", col("resume_save_s", cycles)),
                    _row("  of which the rest (monitor lookup, clock-set task queued)", col("resume_rest_s", cycles)),
                    _row("resume() + exec true answered", col("agent_s", cycles)),
                    _row("suspend()", col("suspend_s", cycles)),
                    _row("  of which QMP stop round trip", col("qmp_stop_s", cycles)),
                    _row("  of which machine.json written", col("suspend_save_s", cycles)),
                    _row("  of which the rest (process check, monitor lookup)", col("suspend_rest_s", cycles)),
                    _row("baseline, running machine: QMP query-status round trip", queries),
                    _row("baseline, running machine: exec true", trips),
                    ["paused while suspended, running after (info + query-status)",
                     f"{runs - not_paused_running}/{runs}", "", "", ""],
                    ["token in the process's memory unchanged", f"{runs - suspend_mismatches}/{runs}", "",
                     f"mismatches: {suspend_mismatches}", ""],
                ],
            )

            # -- hibernate and wake ----------------------------------------------------
            naps = []
            for index in range(hibernations):
                with console.status(f"hibernate and wake {index + 1}/{hibernations}"):
                    naps.append(await ib.hibernate_cycle(vm, crc))
                n = naps[-1]
                console.print(
                    f"hibernation {index + 1}: hibernate() {ms(n['hibernate_s'])}, file {mib(n['file_bytes'])}, "
                    f"freed {mib(n['freed_bytes'])} (held after: {mib(n['memory_after']['held_bytes'])}); "
                    f"wake: vCPUs run after {ms(n['resume_s'])}, agent after {ms(n['ready_s'])}; "
                    f"token {'same' if n['token_matches'] else 'MISMATCH: ' + n['token']}, "
                    f"CRC {'same' if n['crc_matches'] else 'MISMATCH: ' + n['crc']}"
                )
            wake_ready = col("ready_s", naps)
            wake_resume = col("resume_s", naps)
            wake_p50 = percentile(wake_ready, 50)
            hib_values = col("hibernate_s", naps)
            token_mismatches = sum(not n["token_matches"] for n in naps)
            crc_mismatches = sum(not n["crc_matches"] for n in naps)
            not_running = sum(n["vcpus_after"] != "running" or n["state_after"] != "running" for n in naps)
            not_stopped = sum(n["state_hibernated"] != VMState.STOPPED.value or n["pid_hibernated"] is not None
                              for n in naps)
            hib_phase_names = list(naps[0]["hibernate_phases"]) if naps[0]["hibernate_phases"] else []
            wake_phase_names = list(naps[0]["wake_phases"]) if naps[0]["wake_phases"] else []
            hib_phases = {p: median([n["hibernate_phases"][p] for n in naps if p in n["hibernate_phases"]])
                          for p in hib_phase_names}
            wake_phases = {p: median([n["wake_phases"][p] for n in naps if p in n["wake_phases"]])
                           for p in wake_phase_names}
            results["hibernate"] = {
                "hibernate_s": summary(hib_values),
                "phases_median_s": hib_phases,
                "file_bytes": summary(col("file_bytes", naps)),
                "file_allocated_bytes": summary(col("file_allocated_bytes", naps)),
                "not_stopped_while_hibernated": not_stopped,
            }
            results["wake_hibernated"] = {
                "resume_s": summary(wake_resume),
                "ready_s": summary(wake_ready),
                "phases_median_s": wake_phases,
                "over_fresh_boot": wake_p50 / boot,
                "token_mismatches": token_mismatches,
                "crc_mismatches": crc_mismatches,
                "not_running_after": not_running,
                "samples": naps,
            }
            report.table(
                f"Hibernate and wake: {hibernations} cycles of hibernate(), resume(), wait_ready()",
                ["metric", "p50", "p95", "min", "max", "/ fresh boot p50"],
                [
                    _row("hibernate()", hib_values, ms),
                    *[["  " + p, ms(v), "", "", "", ""] for p, v in hib_phases.items()],
                    _row("wake: resume() until it returns (vCPUs run)", wake_resume, ms,
                         [_x(percentile(wake_resume, 50), boot)]),
                    *[["  " + p, fine(v), "", "", "", ""] for p, v in wake_phases.items()],
                    _row("wake: resume() + wait_ready() (agent answers)", wake_ready, ms, [_x(wake_p50, boot)]),
                    _row("fresh boot (baseline)", boot_values, ms, ["1.00x"]),
                    ["stopped (no pid) while hibernated; running after the wake",
                     f"{hibernations - not_stopped}/{hibernations}; {hibernations - not_running}/{hibernations}",
                     "", "", "", ""],
                    ["token in the process's memory unchanged", f"{hibernations - token_mismatches}/{hibernations}",
                     "", f"mismatches: {token_mismatches}", "", ""],
                    [f"CRC-32 of the {fill_mib} MiB held unchanged", f"{hibernations - crc_mismatches}/{hibernations}",
                     "", f"mismatches: {crc_mismatches}", "", ""],
                ],
            )

            # -- memory ----------------------------------------------------------------
            # The first hibernation is of the machine as booted; every later one is of a
            # machine woken from hibernation, whose RAM file the state load wrote whole.
            def mem(samples: list[dict[str, Any]], side: str, path: str) -> float:
                values = []
                for n in samples:
                    value: Any = n[side]
                    for key in path.split("."):
                        value = value.get(key, 0) if isinstance(value, dict) else 0
                    values.append(value)
                return median(values)

            first, later = naps[:1], naps[1:]
            columns = [("before: 1st (as booted)", first, "memory_before")]
            if later:
                columns.append((f"before: later {len(later)} (woken, median)", later, "memory_before"))
            columns.append((f"after (median of {hibernations})", naps, "memory_after"))

            def mem_row(label: str, path: str) -> list[str]:
                return [label, *(mib(mem(group, side, path)) for _, group, side in columns)]

            def parts(group: list[dict[str, Any]], side: str) -> str:
                return " / ".join(mib(mem(group, side, f"qemu.{k}")) for k in ("Pss_Anon", "Pss_File", "Pss_Shmem"))

            held_first = mem(first, "memory_before", "held_bytes")
            held_before = mem(naps, "memory_before", "held_bytes")
            held_after = mem(naps, "memory_after", "held_bytes")
            freed = median(col("freed_bytes", naps))
            all_freed = all(n["all_freed"] for n in naps)
            file_p50 = median(col("file_bytes", naps))
            available_rise = median([n["mem_available_after"] - n["mem_available_before"] for n in naps])
            results["memory"] = {
                "held_before_first_bytes": held_first,
                "held_before_later_bytes": mem(later, "memory_before", "held_bytes") if later else None,
                "held_before_bytes": held_before,
                "held_after_bytes": held_after,
                "freed_bytes": freed,
                "all_freed": all_freed,
                "hibernation_file_bytes": file_p50,
                "mem_available_rise_bytes": available_rise,
                "guest_used_bytes": guest["used"],
            }
            blank = [""] * (len(columns) - 1)
            report.table(
                "Memory the machine holds on the host, right before and right after hibernate()",
                ["metric", *(label for label, _, _ in columns)],
                [
                    mem_row("QEMU PSS (smaps_rollup)", "qemu.Pss"),
                    ["  anon / file / shmem (the RAM file mapped)", *(parts(g, side) for _, g, side in columns)],
                    mem_row("passt PSS", "passt.Pss"),
                    mem_row("RAM file on tmpfs (allocated blocks)", "ram_file_bytes"),
                    mem_row("run folder on tmpfs (RAM file, sockets, pidfiles)", "run_dir_bytes"),
                    mem_row("held: QEMU PSS - shmem + passt PSS + run folder", "held_bytes"),
                    ["processes alive (QEMU, passt)",
                     *(f"{sum(n[side]['qemu_alive'] for n in g)}, {sum(n[side]['passt_alive'] for n in g)} of {len(g)}"
                       for _, g, side in columns)],
                    ["hibernation.zst on disk (size / allocated)", *blank,
                     f"{mib(file_p50)} / {mib(median(col('file_allocated_bytes', naps)))}"],
                    [f"  / guest RAM ({MEMORY_MIB} MiB); / RAM used in the guest ({mib(guest['used'])})", *blank,
                     f"{file_p50 / (MEMORY_MIB * MiB) * 100:.0f} %; {file_p50 / guest['used'] * 100:.0f} %"],
                    ["host MemAvailable rose by (0.5 s after; noisy, shared host)", *blank, mib(available_rise)],
                ],
            )
            if later and mem(later, "memory_before", "ram_file_bytes") > mem(first, "memory_before", "ram_file_bytes"):
                report.note("a machine woken from hibernation holds more of its RAM file on tmpfs than it did as "
                            f"booted ({mib(mem(later, 'memory_before', 'ram_file_bytes'))} against "
                            f"{mib(mem(first, 'memory_before', 'ram_file_bytes'))}): after the saved state is loaded "
                            "every page of the file is allocated, zero pages included")
            report.note("each wake from hibernation reads hibernation.zst just written, so from the host's "
                        "page cache: a machine hibernated long ago may read it from disk")

        # -- targets -------------------------------------------------------------------
        cont_p50 = percentile(col("qmp_cont_s", cycles), 50)
        report.target(
            "wake from suspended < 1 ms (p50)",
            f"resume() p50 {fine(resume_p50)}, p95 {fine(percentile(resume_values, 95))} "
            f"(QMP cont {fine(cont_p50)}); token mismatches {suspend_mismatches}/{runs}",
            "< 1 ms", resume_p50 < 1e-3 and suspend_mismatches == 0,
        )
        report.target(
            "wake from hibernated faster than a fresh boot",
            f"{ms(wake_p50)} vs {ms(boot)} = {wake_p50 / boot:.2f}x ({boot / wake_p50:.1f}x faster; vCPUs ran after "
            f"{ms(percentile(wake_resume, 50))}); token / CRC mismatches {token_mismatches} / {crc_mismatches} "
            f"of {hibernations}",
            "< 1.00x", wake_p50 < boot and token_mismatches == 0 and crc_mismatches == 0,
        )
        report.target(
            "hibernation frees the machine's memory",
            f"{mib(held_before)} -> {mib(held_after)} (median; as booted {mib(held_first)}; QEMU, passt and "
            f"RAM file gone in "
            f"{sum(n['all_freed'] for n in naps)}/{hibernations}); hibernation.zst {mib(file_p50)} on disk",
            "0 after", all_freed,
        )
        report.print_targets()
    report.write_json(args.json)


if __name__ == "__main__":
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="5 suspend cycles and 3 hibernations (a smoke run)")
    parser.add_argument("--runs", type=int, help="suspend/resume cycles and exec round trips (default 20, quick 5)")
    parser.add_argument("--hibernations", type=int,
                        help="hibernate/wake cycles, and fresh boots for the baseline (default 5, quick 3)")
    parser.add_argument("--hold", type=float, default=1.0, help="seconds a machine stays suspended (default 1)")
    parser.add_argument("--fill", type=int, default=150,
                        help="MiB of random bytes the guest process holds (default 150)")
    arguments = parser.parse_args()
    raise SystemExit(run(lambda: main(arguments)))
