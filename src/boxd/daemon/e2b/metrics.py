"""Sandbox metrics, as E2B's API reports them (``GET /sandboxes/{id}/metrics``): a series of
samples, one every ``SAMPLE_INTERVAL_S`` of each running sandbox, kept for ``HISTORY_S``.

A sample is taken inside the guest through its agent, as envd measures itself: the CPU
count and use from ``/proc/stat`` (the share of time busy since the sandbox's previous
sample, or since boot for its first), memory from ``/proc/meminfo`` as gopsutil reads it,
and the disk from statvfs of ``/`` (used is what users can no longer have). Paused
sandboxes are not sampled (that would wake them); their series keeps what it has.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import time
from collections import deque
from dataclasses import dataclass

from boxd.daemon.store import Store
from boxd.errors import BoxdError
from boxd.models import MachineState
from boxd.runtime.interface import Runtime

log = logging.getLogger(__name__)

SAMPLE_INTERVAL_S = 5.0  # E2B's collection interval
HISTORY_S = 3600.0
PROBE_TIMEOUT_S = 10.0


@dataclass(frozen=True)
class CpuTimes:
    """The ``cpu`` line of /proc/stat, in ticks: all of it (guest time is inside user time,
    so it is not counted twice) and the part neither idle nor waiting for I/O."""

    total: int
    busy: int


@dataclass(frozen=True)
class Memory:
    total: int
    used: int
    cache: int


@dataclass(frozen=True)
class Sample:
    timestamp: float
    cpu_count: int
    cpu_used_pct: float
    mem_used: int
    mem_total: int
    mem_cache: int
    disk_used: int
    disk_total: int


def read_proc_stat(text: str) -> tuple[int, CpuTimes]:
    """The number of CPUs and the times of all of them together."""
    count, times = 0, CpuTimes(0, 0)
    for line in text.splitlines():
        fields = line.split()
        if not fields:
            continue
        if fields[0] == "cpu":
            # user nice system idle iowait irq softirq steal (guest, guest_nice: in user already)
            ticks = [int(value) for value in fields[1:9]]
            idle = ticks[3] + (ticks[4] if len(ticks) > 4 else 0)
            times = CpuTimes(total=sum(ticks), busy=sum(ticks) - idle)
        elif fields[0].startswith("cpu") and fields[0][3:].isdigit():
            count += 1
    return count, times


def cpu_used_pct(before: CpuTimes, after: CpuTimes) -> float:
    """Percent busy between two readings, rounded to 2 places, as gopsutil and envd give it."""
    if after.busy <= before.busy:
        return 0.0
    if after.total <= before.total:
        return 100.0
    share = (after.busy - before.busy) / (after.total - before.total) * 100
    return round(min(100.0, max(0.0, share)), 2)


def read_meminfo(text: str) -> Memory:
    """As gopsutil does: the page cache counts reclaimable slab, and used is what is neither
    free, buffers nor cache."""
    kib = {}
    for line in text.splitlines():
        name, _, rest = line.partition(":")
        with contextlib.suppress(ValueError, IndexError):
            kib[name.strip()] = int(rest.split()[0])
    total, cache = kib.get("MemTotal", 0) * 1024, (kib.get("Cached", 0) + kib.get("SReclaimable", 0)) * 1024
    used = total - (kib.get("MemFree", 0) + kib.get("Buffers", 0)) * 1024 - cache
    return Memory(total=total, used=max(0, used), cache=cache)


async def _text(runtime: Runtime, vm_id: str, path: str) -> str:
    return b"".join([chunk async for chunk in runtime.read_file(vm_id, path)]).decode(errors="replace")


class MetricsSampler:
    """Samples every running sandbox now and then, and answers for a time range."""

    def __init__(self, store: Store, runtime: Runtime, *, interval_s: float = SAMPLE_INTERVAL_S,
                 history_s: float = HISTORY_S) -> None:
        self._store = store
        self._runtime = runtime
        self._interval_s = interval_s
        self._series: dict[str, deque[Sample]] = {}
        self._last_cpu: dict[str, CpuTimes] = {}
        self._keep = max(1, int(history_s / interval_s))
        self._task: asyncio.Task | None = None

    def start(self) -> None:
        self._task = asyncio.create_task(self._run(), name="e2b-metrics")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task

    async def _run(self) -> None:
        while True:
            try:
                await self.sample_all()
            except Exception:  # one bad pass (the store busy, say) must not end the sampling
                log.exception("sampling the sandboxes' metrics failed")
            await asyncio.sleep(self._interval_s)

    async def sample_all(self) -> None:
        """One sample of each running sandbox; the series of deleted ones are dropped."""
        live = self._store.live_sandboxes()
        for gone in self._series.keys() - {machine.id for _, machine in live}:
            del self._series[gone]
            self._last_cpu.pop(gone, None)
        running = [machine.id for _, machine in live if machine.state is MachineState.RUNNING]
        await asyncio.gather(*(self._sample(machine_id) for machine_id in running))

    async def _sample(self, machine_id: str) -> None:
        # The runtime itself, not the machine service: a sample is no use of the machine,
        # so it neither wakes it nor keeps it from going idle.
        try:
            sample = await asyncio.wait_for(self._measure(machine_id), PROBE_TIMEOUT_S)
        except (BoxdError, asyncio.TimeoutError) as error:  # stopped meanwhile, or the agent busy
            log.debug("no metrics sample of %s: %s", machine_id, error)
            return
        self._series.setdefault(machine_id, deque(maxlen=self._keep)).append(sample)

    async def _measure(self, machine_id: str) -> Sample:
        proc_stat, meminfo, root = await asyncio.gather(
            _text(self._runtime, machine_id, "/proc/stat"),
            _text(self._runtime, machine_id, "/proc/meminfo"),
            self._runtime.fs(machine_id, "stat", path="/", filesystem=True),
        )
        cpu_count, cpu = read_proc_stat(proc_stat)
        used_pct = cpu_used_pct(self._last_cpu.get(machine_id, CpuTimes(0, 0)), cpu)
        self._last_cpu[machine_id] = cpu
        memory = read_meminfo(meminfo)
        disk = root.get("filesystem") or {}  # an older agent does not tell it
        disk_total = int(disk.get("total", 0))
        return Sample(
            timestamp=time.time(), cpu_count=cpu_count, cpu_used_pct=used_pct,
            mem_used=memory.used, mem_total=memory.total, mem_cache=memory.cache,
            disk_used=disk_total - int(disk.get("available", 0)), disk_total=disk_total,
        )

    def series(self, machine_id: str, *, start: int | None, end: int | None) -> list[Sample]:
        """The samples of a sandbox from ``start`` through ``end`` (Unix seconds, either open)."""
        return [
            sample for sample in self._series.get(machine_id, ())
            if (start is None or sample.timestamp >= start) and (end is None or int(sample.timestamp) <= end)
        ]
