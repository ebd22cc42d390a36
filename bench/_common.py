"""What the benchmarks share: the event loop runner, a runtime in a throwaway home whose
machines are always deleted, percentiles, host measurements, and table + JSON output.

Benchmarks only measure and print. Nothing here asserts a timing: a target that is
missed is reported as "miss", never raised.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import os
import platform
import re
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Self

try:
    import boxd  # noqa: F401
except ImportError:  # run from a checkout that is not installed
    sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "src"))

from rich.console import Console
from rich.table import Table

from boxd.errors import NotFound
from boxd.guest.image import Image, ImageRecipe, ensure_image
from boxd.runtime.interface import ExecRequest, VMSpec
from boxd.runtime.local import LocalRuntime, stop_processes

# Wide enough for the tables when the output goes to a file (rich would assume 80 columns).
console = Console(width=None if sys.stdout.isatty() else 180)
MiB = 1024 * 1024


# -- running ----------------------------------------------------------------------------


def run(main: Callable[[], Awaitable[Any]]) -> int:
    """Run ``main()`` on one event loop. Ctrl-C or SIGTERM cancel it, so that every
    ``finally`` (and with it machine cleanup) still runs; returns an exit status."""

    async def wrapper() -> Any:
        task = asyncio.current_task()
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError):
            loop.add_signal_handler(signal.SIGTERM, task.cancel)
        return await main()

    try:
        asyncio.run(wrapper())
    except (KeyboardInterrupt, asyncio.CancelledError):
        console.print("[yellow]interrupted; machines were deleted[/yellow]")
        return 130
    return 0


def base_parser(description: str) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=description)
    parser.add_argument("--json", type=Path, metavar="PATH", help="also write every result and raw sample here")
    parser.add_argument("--keep-home", action="store_true", help="leave the temporary BOXD_HOME (logs) behind")
    return parser


def bench_image() -> Image:
    home = Path(os.environ.get("BOXD_BENCH_IMAGE_HOME", "~/.cache/boxd-test")).expanduser()
    with console.status(f"guest image in {home} (the first build takes ~90 s)"):
        return ensure_image(ImageRecipe(), home=home)


# -- statistics -------------------------------------------------------------------------


def percentile(values: Sequence[float], p: float) -> float:
    """The p-th percentile (0-100), linear between closest ranks (numpy's default)."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = (len(ordered) - 1) * p / 100
    low = int(rank)
    high = min(low + 1, len(ordered) - 1)
    return ordered[low] + (ordered[high] - ordered[low]) * (rank - low)


def median(values: Sequence[float]) -> float:
    return statistics.median(values) if values else float("nan")


def summary(values: Sequence[float]) -> dict[str, Any]:
    return {
        "n": len(values),
        "p50": percentile(values, 50),
        "p95": percentile(values, 95),
        "min": min(values) if values else None,
        "max": max(values) if values else None,
        "samples": list(values),
    }


def ms(seconds: float) -> str:
    return f"{seconds * 1000:.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


def mib(nbytes: float) -> str:
    return f"{nbytes / MiB:.1f} MiB"


# -- the runtime in a throwaway home ----------------------------------------------------


class TrackedMachines:
    """Machines a bench makes through a runtime (this host's or a cluster's): every id
    handed to ``track`` (do it before create or fork, so a half made machine counts too)
    is one to delete on the way out."""

    runtime: Any

    def __init__(self) -> None:
        self.tracked: list[str] = []

    def track(self, vm_id: str) -> str:
        self.tracked.append(vm_id)
        return vm_id

    async def delete(self, vm_id: str) -> None:
        assert self.runtime is not None
        try:
            await self.runtime.delete(vm_id)
        except NotFound:
            pass
        except Exception as error:  # noqa: BLE001 -- keep going: the sweep at the end catches it
            console.print(f"[red]could not delete {vm_id}: {error}[/red]")
        with contextlib.suppress(ValueError):
            self.tracked.remove(vm_id)

    async def sh(self, vm_id: str, command: str, *, timeout: float = 300, check: bool = True) -> str:
        """Run a shell command in the guest and return its stdout."""
        assert self.runtime is not None
        events = [e async for e in self.runtime.exec(vm_id, ExecRequest(shell=command, timeout=timeout))]
        exit_code = events[-1].exit_code
        out = b"".join(e.data for e in events if e.kind == "stdout").decode(errors="replace")
        if check and exit_code != 0:
            err = b"".join(e.data for e in events if e.kind == "stderr").decode(errors="replace")
            raise RuntimeError(f"{vm_id}: {command!r} exited {exit_code}: {err.strip()[-300:]}")
        return out.strip()


class Bench(TrackedMachines):
    """A ``LocalRuntime`` in a fresh temporary BOXD_HOME.

    Tracked machines are deleted on the way out, whatever ended the run; then every QEMU
    still running from this home's run folders is killed and the home removed.
    """

    def __init__(self, image: Image, *, keep_home: bool = False) -> None:
        super().__init__()
        self.image = image
        self.keep_home = keep_home
        self.home = Path(tempfile.mkdtemp(prefix="boxd-bench-"))
        self.runtime: LocalRuntime | None = None

    async def __aenter__(self) -> Self:
        self.runtime = LocalRuntime(self.home)
        return self

    async def __aexit__(self, *exc_info: object) -> None:
        # Cleanup must not be cut short by a second Ctrl-C.
        loop = asyncio.get_running_loop()
        with contextlib.suppress(NotImplementedError, RuntimeError):
            loop.add_signal_handler(signal.SIGINT, lambda: console.print("[yellow]cleaning up, please wait[/yellow]"))
        try:
            await asyncio.shield(self._cleanup())
        finally:
            with contextlib.suppress(NotImplementedError, RuntimeError):
                loop.remove_signal_handler(signal.SIGINT)

    async def _cleanup(self) -> None:
        runtime = self.runtime
        assert runtime is not None
        for vm_id in list(self.tracked):
            await self.delete(vm_id)
        await runtime.close()
        # Whatever is left (a machine interrupted half way, a bare QEMU of a baseline).
        await sweep(runtime.shm_dir)
        shutil.rmtree(runtime.shm_dir, ignore_errors=True)
        if self.keep_home:
            console.print(f"home kept at {self.home}")
        else:
            shutil.rmtree(self.home, ignore_errors=True)

    def spec(self, memory_mib: int = 512, **fields: Any) -> VMSpec:
        return VMSpec(image=str(self.image.path), memory_mib=memory_mib, **fields)

    async def boot(self, vm_id: str, memory_mib: int = 512, timeout: float = 180) -> dict[str, float]:
        """Create a machine and wait until its agent answers; returns timings in seconds."""
        assert self.runtime is not None
        self.track(vm_id)
        started = time.monotonic()
        await self.runtime.create(vm_id, self.spec(memory_mib))
        launched = time.monotonic()
        await self.runtime.wait_ready(vm_id, timeout)
        ready = time.monotonic()
        return {"qemu_started_s": launched - started, "ready_s": ready - started}

    async def argv(self, vm_id: str, argv: list[str]) -> int | None:
        assert self.runtime is not None
        exit_code = None
        async for event in self.runtime.exec(vm_id, ExecRequest(argv=argv)):
            if event.kind == "exit":
                exit_code = event.exit_code
        return exit_code

    def machine_record(self, vm_id: str) -> dict[str, Any]:
        """The machine's machine.json, the runtime's own on-disk record of it."""
        assert self.runtime is not None
        return json.loads((self.runtime.vms_dir / vm_id / "machine.json").read_text())


async def chunks_of(data: bytes, size: int = MiB) -> AsyncIterator[bytes]:
    view = memoryview(data)
    for offset in range(0, len(data), size):
        yield bytes(view[offset : offset + size])


# -- host measurements ------------------------------------------------------------------


def smaps_rollup(pid: int) -> dict[str, int]:
    """Memory of a process from /proc/PID/smaps_rollup, in bytes (Rss, Pss, Pss_Anon...)."""
    values: dict[str, int] = {}
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        match = re.match(r"^(\w+):\s+(\d+) kB", line)
        if match:
            values[match.group(1)] = int(match.group(2)) * 1024
    return values


def allocated_bytes(path: Path) -> int:
    """Blocks really allocated (not the apparent size) of a file or of a folder's files."""
    if path.is_file():
        return path.stat().st_blocks * 512
    return sum(p.stat().st_blocks * 512 for p in path.rglob("*") if p.is_file())


def mem_available() -> int:
    for line in Path("/proc/meminfo").read_text().splitlines():
        if line.startswith("MemAvailable:"):
            return int(line.split()[1]) * 1024
    return 0


def host_facts(runtime: LocalRuntime | None = None) -> dict[str, Any]:
    qemu = subprocess.run(["qemu-system-x86_64", "--version"], check=False, capture_output=True, text=True).stdout
    load = os.getloadavg()
    return {
        "host": platform.node(),
        "kernel": platform.release(),
        "cpus": os.cpu_count(),
        "mem_available_mib": mem_available() // MiB,
        "loadavg_at_start": [round(x, 2) for x in load],
        "qemu": qemu.splitlines()[0] if qemu else None,
        "accelerator": runtime.accelerator.name if runtime else None,
        "accelerator_reason": runtime.accelerator.reason if runtime else None,
        "python": platform.python_version(),
        "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }


class LogCapture(logging.Handler):
    """Keeps the records of one logger, without printing them."""

    def __init__(self, logger_name: str) -> None:
        super().__init__(logging.INFO)
        self.records: list[logging.LogRecord] = []
        self.logger = logging.getLogger(logger_name)

    def emit(self, record: logging.LogRecord) -> None:
        self.records.append(record)

    def __enter__(self) -> Self:
        self.logger.addHandler(self)
        self._level = self.logger.level
        if self.logger.getEffectiveLevel() > logging.INFO:
            self.logger.setLevel(logging.INFO)
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.logger.removeHandler(self)
        self.logger.setLevel(self._level)

    def values(self, pattern: str) -> list[tuple[str, float]]:
        """(message, number) for every kept message matching ``pattern`` (one group)."""
        found = []
        for record in self.records:
            message = record.getMessage()
            match = re.search(pattern, message)
            if match:
                found.append((message, float(match.group(1))))
        return found


# -- output -----------------------------------------------------------------------------


@dataclass
class Target:
    name: str
    measured: str
    goal: str
    ok: bool | None  # None: not measured in this run


@dataclass
class Report:
    """Tables for the terminal and the same numbers, with raw samples, as JSON."""

    title: str
    args: dict[str, Any]
    results: dict[str, Any] = field(default_factory=dict)
    tables: list[Table] = field(default_factory=list)
    targets: list[Target] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    host: dict[str, Any] = field(default_factory=dict)

    def table(self, title: str, columns: Sequence[str], rows: Sequence[Sequence[Any]]) -> Table:
        table = Table(title=title, title_justify="left", title_style="bold")
        for index, column in enumerate(columns):
            table.add_column(column, justify="left" if index == 0 else "right")
        for row in rows:
            table.add_row(*(str(cell) for cell in row))
        self.tables.append(table)
        console.print(table)
        return table

    def target(self, name: str, measured: str, goal: str, ok: bool | None) -> None:
        self.targets.append(Target(name, measured, goal, ok))

    def note(self, text: str) -> None:
        self.notes.append(text)
        console.print(f"[dim]note:[/dim] {text}")

    def print_targets(self) -> None:
        if not self.targets:
            return
        table = Table(title="Targets", title_justify="left", title_style="bold")
        for column in ("target", "measured", "goal", "result"):
            table.add_column(column, justify="left" if column in ("target", "goal") else "right")
        for target in self.targets:
            verdict = {True: "[green]pass[/green]", False: "[red]miss[/red]", None: "[dim]n/a[/dim]"}[target.ok]
            table.add_row(target.name, target.measured, target.goal, verdict)
        self.tables.append(table)
        console.print(table)

    def write_json(self, path: Path | None) -> None:
        if path is None:
            return
        self.host["loadavg_at_end"] = [round(x, 2) for x in os.getloadavg()]
        data = {
            "benchmark": self.title,
            "args": self.args,
            "host": self.host,
            "results": self.results,
            "targets": [vars(t) for t in self.targets],
            "notes": self.notes,
        }
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(data, indent=2, default=str) + "\n")
        console.print(f"results written to {path}")


# -- processes ---------------------------------------------------------------------------


async def sweep(shm_dir: Path) -> None:
    """End every QEMU and passt still running from the run folders under ``shm_dir``."""
    if not shm_dir.is_dir():
        return
    for run_dir in shm_dir.iterdir():
        if not run_dir.is_dir():
            continue
        await stop_processes(run_dir)


# -- a process whose memory can be told apart ---------------------------------------------

# How a guest script begins that fills (and holds) sys.argv[1] MiB with random bytes.
FILL_MEMORY = r"""
import os, secrets, sys, time, zlib
size = int(sys.argv[1]) << 20
held = bytearray(size)
view = memoryview(held)
with open("/dev/urandom", "rb", buffering=0) as source:  # straight in: no second copy
    for offset in range(0, size, 1 << 20):
        source.readinto(view[offset : offset + (1 << 20)])
"""

HOLDER_PATH = "/home/boxd/holder.py"
# Fills (and holds) some memory with random bytes, then keeps a random token in memory
# only: it writes the token to /tmp/token when /tmp/ask appears, draws a new one when
# /tmp/rotate appears, and writes the CRC-32 of the held bytes to /tmp/crc when /tmp/sum
# appears. Both can only come back after a restore or a wake if the process's memory does.
HOLDER = FILL_MEMORY + r"""
token = secrets.token_hex(16)
open("/tmp/filled", "w").close()

def answer(name, text):
    with open(f"/tmp/{name}.part", "w") as out:
        out.write(text)
    os.replace(f"/tmp/{name}.part", f"/tmp/{name}")

while True:
    if os.path.exists("/tmp/rotate"):
        token = secrets.token_hex(16)
        os.unlink("/tmp/rotate")
    if os.path.exists("/tmp/ask"):
        os.unlink("/tmp/ask")
        answer("token", token)
    if os.path.exists("/tmp/sum"):
        os.unlink("/tmp/sum")
        answer("crc", f"{zlib.crc32(held):08x}")
    time.sleep(0.02)
"""

# Bounded waits, so that a holder that did not come back reads as "missing" instead of
# hanging the bench: 30 s for the token, 120 s for the CRC (150 MiB under TCG).
ASK = (
    "rm -f /tmp/token; touch /tmp/ask; "
    "for i in $(seq 600); do [ -s /tmp/token ] && break; sleep 0.05; done; "
    "cat /tmp/token 2>/dev/null || echo missing"
)
SUM = (
    "rm -f /tmp/crc; touch /tmp/sum; "
    "for i in $(seq 2400); do [ -s /tmp/crc ] && break; sleep 0.05; done; "
    "cat /tmp/crc 2>/dev/null || echo missing"
)
ROTATE = "touch /tmp/rotate; for i in $(seq 600); do [ -e /tmp/rotate ] || break; sleep 0.05; done"


async def start_filling(bench: TrackedMachines, vm_id: str, path: str, script: str, fill_mib: int) -> None:
    """Run a guest script that fills ``fill_mib`` MiB of memory in the background, and
    wait until it says so (/tmp/filled); one that dies says why (its log, the OOM killer)."""
    assert bench.runtime is not None
    name = Path(path).name
    await bench.runtime.write_file(vm_id, path, chunks_of(script.encode()))
    await bench.sh(vm_id, f"nohup python3 {path} {fill_mib} >/tmp/{name}.log 2>&1 &")
    deadline = time.monotonic() + 600
    while await bench.sh(vm_id, "test -e /tmp/filled && echo yes || echo no") != "yes":
        if time.monotonic() > deadline:
            raise RuntimeError(f"{vm_id}: filling {fill_mib} MiB took over 10 min")
        if await bench.sh(vm_id, f"pgrep -f {name} >/dev/null && echo up || echo down") == "down":
            log_text = await bench.sh(vm_id, f"cat /tmp/{name}.log; dmesg | grep -i 'killed process' | tail -1")
            raise RuntimeError(f"{vm_id}: {name} died: {log_text}")
        await asyncio.sleep(1)


class HolderBench:
    """A bench whose machines run the holder: starting it, asking it, and what a guest
    says of its memory."""

    def __init__(self, bench: Bench) -> None:
        self.bench = bench
        self.runtime = bench.runtime
        self.tag = os.getpid() % 10000

    async def settle(self, seconds: float = 0.5) -> None:
        """Let the runtime's background work (hole punching of a capture's RAM file, the
        guest clock set after a wake) end, so that it does not land in the next measurement."""
        pending = list(getattr(self.runtime, "_background", ()))
        if pending:
            await asyncio.gather(*pending, return_exceptions=True)
        await asyncio.sleep(seconds)

    async def token(self, vm_id: str) -> str:
        return await self.bench.sh(vm_id, ASK, timeout=60)

    async def crc(self, vm_id: str) -> str:
        return await self.bench.sh(vm_id, SUM, timeout=180)

    async def start_holder(self, vm_id: str, fill_mib: int) -> None:
        await start_filling(self.bench, vm_id, HOLDER_PATH, HOLDER, fill_mib)

    async def guest_memory(self, vm_id: str) -> dict[str, int]:
        """``free -b`` in the guest: its RAM as the kernel sees it, used, and shared (tmpfs)."""
        total, used, shared = (await self.bench.sh(vm_id, "free -b | awk '/Mem:/ {print $2, $3, $5}'")).split()
        return {"total": int(total), "used": int(used), "shared": int(shared)}

    async def fresh_boots(
        self, report: Report, prefix: str, runs: int, memory_mib: int, timeout: float
    ) -> tuple[str, list[float]]:
        """The baseline: ``runs`` fresh boots, of which the last machine stays; returns it
        and each boot's time to a ready agent."""
        bench = self.bench
        boots = []
        for index in range(runs):
            vm_id = f"{prefix}{self.tag}-{index}"
            with console.status(f"baseline: fresh boot {index + 1}/{runs}"):
                boots.append(await bench.boot(vm_id, memory_mib=memory_mib, timeout=timeout))
            console.print(f"fresh boot {index + 1}: {ms(boots[-1]['ready_s'])} "
                          f"(QEMU started after {ms(boots[-1]['qemu_started_s'])})")
            if index < runs - 1:
                await bench.delete(vm_id)
        boot_values = [b["ready_s"] for b in boots]
        launches = [b["qemu_started_s"] for b in boots]
        report.results["fresh_boot"] = summary(boot_values) | {"qemu_started_s": launches}
        report.table(
            "Baseline: fresh boot, create -> agent answering",
            ["metric", "value"],
            [
                ["machine", f"{memory_mib} MiB, {self.runtime.accelerator.name}"],
                ["median", ms(median(boot_values))],
                ["all runs", ", ".join(ms(x) for x in boot_values)],
                ["of which QEMU launch (median)", ms(median(launches))],
            ],
        )
        return f"{prefix}{self.tag}-{runs - 1}", boot_values
