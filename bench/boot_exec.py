"""Boot time, exec round trip and file transfer speed of one machine, through the runtime.

    python bench/boot_exec.py [--runs 5] [--execs 100] [--json out.json]

- boot: ``create`` until the guest agent answers (``wait_ready``), for --runs fresh
  machines one after the other; median and every run.
- exec: round trip of ``true`` in argv form (request sent until its exit event), --execs
  times after 3 unrecorded ones; p50 and p95.
- upload / download: a 64 MiB random file to and from the guest's /tmp (a tmpfs, so the
  guest's disk is left out), median of 3 each; the download is checked against the upload.
"""

from __future__ import annotations

import hashlib
import os
import time

from _common import (
    Bench,
    MiB,
    Report,
    base_parser,
    bench_image,
    chunks_of,
    console,
    host_facts,
    median,
    ms,
    percentile,
    run,
    summary,
)

FILE_BYTES = 64 * MiB
GUEST_FILE = "/tmp/bench-64m.bin"


async def main(args) -> None:
    report = Report("boot_exec", vars(args) | {"json": str(args.json) if args.json else None})
    image = bench_image()
    async with Bench(image, keep_home=args.keep_home) as bench:
        runtime = bench.runtime
        report.host = host_facts(runtime)
        tag = os.getpid() % 10000

        # -- boot --------------------------------------------------------------------
        boots = []
        for index in range(args.runs):
            vm_id = f"boot{tag}-{index}"
            with console.status(f"boot {index + 1}/{args.runs}"):
                timings = await bench.boot(vm_id, memory_mib=args.memory)
            boots.append(timings)
            console.print(f"boot {index + 1}: {ms(timings['ready_s'])} (QEMU started after {ms(timings['qemu_started_s'])})")
            if index < args.runs - 1:
                await bench.delete(vm_id)
        vm = f"boot{tag}-{args.runs - 1}"  # the last one stays for exec and files
        ready = [b["ready_s"] for b in boots]
        report.results["boot"] = summary(ready) | {"qemu_started_s": [b["qemu_started_s"] for b in boots]}
        report.table(
            f"Boot, create -> agent answering ({args.memory} MiB, {runtime.accelerator.name})",
            ["metric", "value"],
            [
                ["median", ms(median(ready))],
                ["min / max", f"{ms(min(ready))} / {ms(max(ready))}"],
                ["all runs", ", ".join(ms(x) for x in ready)],
                ["of which QEMU launch (median)", ms(median([b["qemu_started_s"] for b in boots]))],
            ],
        )

        # -- exec round trip ------------------------------------------------------------
        for _ in range(3):
            await bench.argv(vm, ["true"])
        trips = []
        with console.status(f"{args.execs} x exec true"):
            for _ in range(args.execs):
                started = time.monotonic()
                code = await bench.argv(vm, ["true"])
                trips.append(time.monotonic() - started)
                if code != 0:
                    raise RuntimeError(f"true exited {code}")
        report.results["exec_true"] = summary(trips)
        report.table(
            f"Exec round trip, argv ['true'], {args.execs} runs",
            ["metric", "value"],
            [
                ["p50", f"{percentile(trips, 50) * 1000:.1f} ms"],
                ["p95", f"{percentile(trips, 95) * 1000:.1f} ms"],
                ["min / max", f"{min(trips) * 1000:.1f} / {max(trips) * 1000:.1f} ms"],
            ],
        )

        # -- files ----------------------------------------------------------------------
        payload = os.urandom(FILE_BYTES)
        digest = hashlib.sha256(payload).hexdigest()
        uploads, downloads = [], []
        for index in range(args.file_runs):
            with console.status(f"upload {index + 1}/{args.file_runs}"):
                started = time.monotonic()
                written = await runtime.write_file(vm, GUEST_FILE, chunks_of(payload), mode=0o644)
                uploads.append(time.monotonic() - started)
            if written != FILE_BYTES:
                raise RuntimeError(f"upload wrote {written} bytes, not {FILE_BYTES}")
            with console.status(f"download {index + 1}/{args.file_runs}"):
                received = hashlib.sha256()
                size = 0
                started = time.monotonic()
                async for chunk in runtime.read_file(vm, GUEST_FILE):
                    received.update(chunk)
                    size += len(chunk)
                downloads.append(time.monotonic() - started)
            if size != FILE_BYTES or received.hexdigest() != digest:
                raise RuntimeError(f"download gave {size} bytes that differ from the upload")
            console.print(
                f"files {index + 1}: up {FILE_BYTES / uploads[-1] / 1e6:.1f} MB/s, "
                f"down {FILE_BYTES / downloads[-1] / 1e6:.1f} MB/s"
            )
        up_rate = [FILE_BYTES / s / 1e6 for s in uploads]
        down_rate = [FILE_BYTES / s / 1e6 for s in downloads]
        report.results["upload"] = {"bytes": FILE_BYTES, "seconds": uploads, "mb_per_s": up_rate, "median_mb_per_s": median(up_rate)}
        report.results["download"] = {
            "bytes": FILE_BYTES, "seconds": downloads, "mb_per_s": down_rate, "median_mb_per_s": median(down_rate),
        }
        report.table(
            f"Files, 64 MiB random to/from guest {GUEST_FILE}, median of {args.file_runs} (MB = 10^6 bytes)",
            ["direction", "median", "all runs"],
            [
                ["upload", f"{median(up_rate):.1f} MB/s", ", ".join(f"{x:.1f}" for x in up_rate)],
                ["download", f"{median(down_rate):.1f} MB/s", ", ".join(f"{x:.1f}" for x in down_rate)],
            ],
        )
    report.write_json(args.json)


if __name__ == "__main__":
    parser = base_parser(__doc__.splitlines()[0])
    parser.add_argument("--runs", type=int, default=5, help="boots to time (default 5)")
    parser.add_argument("--execs", type=int, default=100, help="exec round trips to time (default 100)")
    parser.add_argument("--file-runs", type=int, default=3, help="uploads and downloads to time (default 3)")
    parser.add_argument("--memory", type=int, default=512, help="guest RAM in MiB (default 512)")
    arguments = parser.parse_args()
    raise SystemExit(run(lambda: main(arguments)))
