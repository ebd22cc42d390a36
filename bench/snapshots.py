"""Checkpoints, restores and snapshots of a running machine, against a fresh boot.

    python bench/snapshots.py [--quick] [--runs 5] [--json out.json]

All in one run, so that every ratio compares numbers measured on the same machine at
about the same time, on 512 MiB machines in which a Python process holds 150 MiB of
random bytes and a random token that exists only in its memory:

- baseline: a fresh boot (``create`` until the agent answers), --runs times; the last
  machine booted becomes the one that is checkpointed;
- checkpoint: the machine's pause (``CheckpointTaken.pause_s``, vCPUs stopped) and the
  whole ``checkpoint()`` call, --runs checkpoints;
- restore: ``restore()`` until the agent answers again, --runs restores of one
  checkpoint, each after the token was changed; the token read back must be the
  checkpoint's (mismatches are counted);
- snapshot save: ``save_snapshot`` of that checkpoint, --runs times, and its size on
  disk against the guest's RAM size and the RAM the guest uses;
- new machine from the snapshot: ``create(snapshot=...)`` until the agent answers; the
  first one on a host unpacks the snapshot, later ones reuse that, so both are timed,
  --runs rounds each, and each new machine's token is checked too.

``--quick``: 3 of everything instead of 5 (a smoke run of a few minutes).
"""

from __future__ import annotations

import time
from typing import Any

from _common import (
    ROTATE,
    Bench,
    HolderBench,
    LogCapture,
    MiB,
    Report,
    allocated_bytes,
    base_parser,
    bench_image,
    console,
    host_facts,
    median,
    mib,
    ms,
    percentile,
    run,
    summary,
)

MEMORY_MIB = 512
READY_TIMEOUT = 180


class SnapshotBench(HolderBench):
    async def from_snapshot(self, vm_id: str, digest: str, expected: str) -> dict[str, Any]:
        """A new machine at the snapshot's instant: create() until its agent answers."""
        runtime = self.runtime
        unpacked = (runtime.captures_dir / f"snapshot-{digest[:16]}" / "ready").exists()
        self.bench.track(vm_id)
        started = time.monotonic()
        await runtime.create(vm_id, self.bench.spec(MEMORY_MIB), snapshot=digest)
        created = time.monotonic()
        await runtime.wait_ready(vm_id, READY_TIMEOUT)
        ready = time.monotonic()
        token = await self.token(vm_id)
        return {
            "id": vm_id,
            "unpacked_before": unpacked,
            "create_s": created - started,
            "ready_s": ready - started,
            "token": token,
            "token_matches": token == expected,
        }


def _x(value: float, baseline: float) -> str:
    return f"{value / baseline:.2f}x"


async def main(args) -> None:
    runs = args.runs or (3 if args.quick else 5)
    fill_mib = args.fill
    report = Report("snapshots", vars(args) | {"json": str(args.json) if args.json else None, "runs": runs})
    image = bench_image()
    async with Bench(image, keep_home=args.keep_home) as bench:
        runtime = bench.runtime
        report.host = host_facts(runtime)
        results = report.results
        sb = SnapshotBench(bench)
        tag = sb.tag
        with LogCapture("boxd.runtime.local") as logs:
            # -- baseline: fresh boots; the last one stays and is checkpointed ---------------
            vm, boot_values = await sb.fresh_boots(report, "b", runs, MEMORY_MIB, READY_TIMEOUT)
            boot = median(boot_values)

            # -- the machine: a process holds random bytes and a token -----------------------
            with console.status(f"{vm}: a process fills and holds {fill_mib} MiB of random bytes"):
                await sb.start_holder(vm, fill_mib)
            guest = await sb.guest_memory(vm)
            token = await sb.token(vm)
            if len(token) != 32:
                raise RuntimeError(f"{vm}: the holder gave {token!r} as its token")
            results["guest_memory_bytes"] = guest
            console.print(f"{vm}: holder up; guest RAM {mib(guest['total'])} as its kernel sees it, "
                          f"used {mib(guest['used'])}")

            # -- checkpoints -------------------------------------------------------------
            # Taken on the freshly booted machine: once restored, a machine's RAM is a private
            # mapping of its checkpoint, and the runtime then keeps it stopped while its memory
            # moves, so its pause is another number. One checkpoint is kept for the restores
            # and the snapshot, the others are dropped right away.
            checkpoints = []
            kept = None
            for index in range(runs):
                await sb.settle()
                logs_before = len(logs.records)
                with console.status(f"checkpoint {index + 1}/{runs}"):
                    started = time.monotonic()
                    taken = await runtime.checkpoint(vm)
                    call = time.monotonic() - started
                messages = [r.getMessage() for r in logs.records[logs_before:]]
                checkpoints.append({
                    "id": taken.id,
                    "pause_s": taken.pause_s,
                    "call_s": call,
                    "chain_shortened": any("chain shortened" in m for m in messages),
                    "ram_file_bytes": allocated_bytes(runtime.captures_dir / taken.id / "ram"),
                })
                console.print(f"checkpoint {index + 1}: pause {taken.pause_s * 1000:.0f} ms, call {ms(call)}"
                              + (" (the runtime shortened the disk chain in it)" if checkpoints[-1]["chain_shortened"]
                                 else ""))
                if kept is None:
                    kept = taken
                else:
                    await runtime.drop_checkpoint(vm, taken.id)
            assert kept is not None
            pauses = [c["pause_s"] for c in checkpoints]
            calls = [c["call_s"] for c in checkpoints]
            pause_p50 = percentile(pauses, 50)
            results["checkpoint"] = {
                "pause_s": summary(pauses),
                "call_s": summary(calls),
                "samples": checkpoints,
            }
            shortened = [index + 1 for index, c in enumerate(checkpoints) if c["chain_shortened"]]
            report.table(
                f"Checkpoint of a running {MEMORY_MIB} MiB machine holding {fill_mib} MiB of random bytes "
                f"(guest uses {mib(guest['used'])})",
                ["metric", "p50", "p95", "all runs"],
                [
                    ["pause (vCPUs stopped, CheckpointTaken.pause_s)", ms(pause_p50), ms(percentile(pauses, 95)),
                     ", ".join(f"{p * 1000:.0f}" for p in pauses) + " ms"],
                    ["checkpoint() call", ms(percentile(calls, 50)), ms(percentile(calls, 95)),
                     ", ".join(ms(c) for c in calls)],
                ],
            )
            if shortened:
                report.note(f"checkpoint(s) {', '.join(map(str, shortened))} include the runtime shortening the "
                            "machine's disk chain (a block-stream after the capture): their call time is longer")

            # -- restores ----------------------------------------------------------------
            restores = []
            for index in range(runs):
                # Change the token first: only a real rewind of the memory brings the old one back.
                await bench.sh(vm, ROTATE)
                before = await sb.token(vm)
                await sb.settle()
                with console.status(f"restore {index + 1}/{runs}"):
                    started = time.monotonic()
                    await runtime.restore(vm, kept.id)
                    returned = time.monotonic()
                    await runtime.wait_ready(vm, READY_TIMEOUT)
                    ready = time.monotonic()
                after = await sb.token(vm)
                restores.append({
                    "restore_call_s": returned - started,
                    "ready_s": ready - started,
                    "token_before": before,
                    "token_after": after,
                    "token_rotated": before != token and len(before) == 32,
                    "token_matches": after == token,
                })
                console.print(f"restore {index + 1}: {ms(ready - started)} (restore() {ms(returned - started)}); "
                              f"token {'back' if after == token else 'MISMATCH: ' + after}")
            restore_values = [r["ready_s"] for r in restores]
            restore_p50 = percentile(restore_values, 50)
            restore_mismatches = sum(not r["token_matches"] for r in restores)
            not_rotated = sum(not r["token_rotated"] for r in restores)
            results["restore"] = {
                "ready_s": summary(restore_values),
                "restore_call_s": summary([r["restore_call_s"] for r in restores]),
                "token_mismatches": restore_mismatches,
                "token_not_rotated": not_rotated,
                "samples": restores,
            }
            report.table(
                "Restore of one checkpoint: restore() until the agent answers again",
                ["metric", "p50", "p95", "all runs", "/ fresh boot p50"],
                [
                    ["restore + ready", ms(restore_p50), ms(percentile(restore_values, 95)),
                     ", ".join(ms(x) for x in restore_values), _x(restore_p50, boot)],
                    ["of which restore() call", ms(percentile([r["restore_call_s"] for r in restores], 50)),
                     ms(percentile([r["restore_call_s"] for r in restores], 95)),
                     ", ".join(ms(r["restore_call_s"]) for r in restores), ""],
                    ["token in the process's memory = the checkpoint's", f"{runs - restore_mismatches}/{runs}", "",
                     f"mismatches: {restore_mismatches}", ""],
                ],
            )
            if not_rotated:
                report.note(f"{not_rotated} restore(s) started without the token changed first: "
                            "those do not show a rewind")

            # -- snapshot save -----------------------------------------------------------
            await sb.settle()
            capture_ram = allocated_bytes(runtime.captures_dir / kept.id / "ram")
            saves = []
            manifest = None
            for index in range(runs):
                with console.status(f"save_snapshot {index + 1}/{runs}"):
                    started = time.monotonic()
                    manifest = await runtime.save_snapshot(vm, kept.id)
                    saves.append(time.monotonic() - started)
                console.print(f"save {index + 1}: {ms(saves[-1])}, {mib(manifest.size_bytes)} ({manifest.digest[:12]})")
            assert manifest is not None
            digest = manifest.digest
            files = {name: entry["size"] for name, entry in manifest.data["files"].items()}
            size = manifest.size_bytes
            on_disk = allocated_bytes(runtime.snapshots_dir / digest)
            ram_bytes = MEMORY_MIB * MiB
            save_p50 = percentile(saves, 50)
            results["snapshot"] = {
                "digest": digest,
                "save_s": summary(saves),
                "size_bytes": size,
                "files_bytes": files,
                "allocated_bytes": on_disk,
                "guest_ram_bytes": ram_bytes,
                "guest_used_bytes": guest["used"],
                "checkpoint_ram_file_bytes": capture_ram,
                "size_over_guest_ram": size / ram_bytes,
                "size_over_guest_used": size / guest["used"],
            }
            report.table(
                f"Snapshot save of that checkpoint (save_snapshot, {runs} times; the same bytes each time)",
                ["metric", "value"],
                [
                    ["save_snapshot p50", ms(save_p50)],
                    ["all runs", ", ".join(ms(s) for s in saves)],
                    ["guest RAM read per second (p50)", f"{ram_bytes / save_p50 / 1e6:.0f} MB/s"],
                    ["size on disk (manifest: compressed files)", mib(size)],
                    ["of which ram.zst / state.zst / disk.qcow2",
                     " / ".join(mib(files.get(n, 0)) for n in ("ram.zst", "state.zst", "disk.qcow2"))],
                    ["blocks allocated (du)", mib(on_disk)],
                    [f"size / guest RAM ({MEMORY_MIB} MiB)", f"{size / ram_bytes * 100:.0f} %"],
                    [f"size / RAM used in the guest (free: {mib(guest['used'])})",
                     f"{size / guest['used'] * 100:.0f} %"],
                    [f"size / the checkpoint's RAM file (non-zero pages: {mib(capture_ram)})",
                     f"{size / capture_ram * 100:.0f} %" if capture_ram else "-"],
                ],
            )

            # -- new machines from the snapshot --------------------------------------------
            # The checkpointed machine goes: the snapshot stands on its own. Each round: a
            # first machine (the snapshot is unpacked, nothing on the host uses it), then a
            # later one while the first still runs (it reuses the unpacked RAM); both deleted,
            # which lets the runtime remove the unpacked copy before the next round.
            await bench.delete(vm)
            firsts, laters = [], []
            for index in range(runs):
                first_id, later_id = f"n{tag}-{index}-a", f"n{tag}-{index}-b"
                await sb.settle()
                with console.status(f"new from snapshot, round {index + 1}/{runs}: first"):
                    firsts.append(await sb.from_snapshot(first_id, digest, token))
                await sb.settle()
                with console.status(f"new from snapshot, round {index + 1}/{runs}: later"):
                    laters.append(await sb.from_snapshot(later_id, digest, token))
                console.print(
                    f"new from snapshot {index + 1}: first {ms(firsts[-1]['ready_s'])} "
                    f"(create() {ms(firsts[-1]['create_s'])}), later {ms(laters[-1]['ready_s'])} "
                    f"(create() {ms(laters[-1]['create_s'])}); tokens "
                    f"{'back' if firsts[-1]['token_matches'] and laters[-1]['token_matches'] else 'MISMATCH'}"
                )
                await bench.delete(later_id)
                await bench.delete(first_id)
            first_values = [f["ready_s"] for f in firsts]
            later_values = [f["ready_s"] for f in laters]
            first_p50, later_p50 = percentile(first_values, 50), percentile(later_values, 50)
            new_mismatches = sum(not f["token_matches"] for f in firsts + laters)
            results["new_from_snapshot"] = {
                "first_ready_s": summary(first_values),
                "later_ready_s": summary(later_values),
                "first_create_s": [f["create_s"] for f in firsts],
                "later_create_s": [f["create_s"] for f in laters],
                "token_mismatches": new_mismatches,
                "samples": {"first": firsts, "later": laters},
            }
            report.table(
                "New machine from the snapshot: create(snapshot=...) until the agent answers",
                ["machine", "p50", "p95", "all runs", "of which create() (p50)", "/ fresh boot p50",
                 "faster than boot"],
                [
                    ["first on the host (unpacks the snapshot)", ms(first_p50), ms(percentile(first_values, 95)),
                     ", ".join(ms(x) for x in first_values), ms(percentile([f["create_s"] for f in firsts], 50)),
                     _x(first_p50, boot), f"{boot / first_p50:.1f}x"],
                    ["later (reuses the unpacked RAM)", ms(later_p50), ms(percentile(later_values, 95)),
                     ", ".join(ms(x) for x in later_values), ms(percentile([f["create_s"] for f in laters], 50)),
                     _x(later_p50, boot), f"{boot / later_p50:.1f}x"],
                    ["fresh boot (baseline)", ms(boot), ms(percentile(boot_values, 95)),
                     ", ".join(ms(x) for x in boot_values), "", "1.00x", ""],
                    ["token in the process's memory = the checkpoint's", f"{2 * runs - new_mismatches}/{2 * runs}", "",
                     f"mismatches: {new_mismatches}", "", "", ""],
                ],
            )
            reused = [f for f in firsts if f["unpacked_before"]]
            if reused:
                report.note(f"{len(reused)} 'first' machine(s) found the snapshot already unpacked: "
                            "the runtime had not removed it yet")

        # -- targets ---------------------------------------------------------------------
        report.target("checkpoint pause p50 <= 100 ms", f"{pause_p50 * 1000:.0f} ms", "<= 100 ms", pause_p50 <= 0.1)
        report.target(
            "restore faster than fresh boot",
            f"{ms(restore_p50)} vs {ms(boot)} = {restore_p50 / boot:.2f}x ({boot / restore_p50:.1f}x faster); "
            f"token mismatches {restore_mismatches}/{runs}",
            "< 1.00x", restore_p50 < boot,
        )
        report.target(
            "new-from-snapshot faster than fresh boot",
            f"later p50 {ms(later_p50)} vs {ms(boot)} = {later_p50 / boot:.2f}x ({boot / later_p50:.1f}x faster); "
            f"first p50 {ms(first_p50)} = {first_p50 / boot:.2f}x; token mismatches {new_mismatches}/{2 * runs}",
            "< 1.00x", later_p50 < boot,
        )
        report.print_targets()
    report.write_json(args.json)


if __name__ == "__main__":
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="3 repetitions of everything instead of 5 (a smoke run)")
    parser.add_argument("--runs", type=int, help="repetitions of each measurement (default 5, quick 3)")
    parser.add_argument("--fill", type=int, default=150,
                        help="MiB of random bytes the guest process holds (default 150)")
    arguments = parser.parse_args()
    raise SystemExit(run(lambda: main(arguments)))
