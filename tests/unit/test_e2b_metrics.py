"""Sandbox metrics: what is read from a guest's /proc and root filesystem, the sampled
series, and GET /sandboxes/{id}/metrics over a FakeRuntime whose guests have those files."""

from __future__ import annotations

import time
from typing import Any

import pytest
from fakes import ControlPlane, FakeRuntime

from boxd.daemon.e2b.metrics import CpuTimes, Memory, cpu_used_pct, read_meminfo, read_proc_stat

pytestmark = pytest.mark.anyio

E2B = "/e2b"
GIB = 1 << 30


def proc_stat(user: int, idle: int, iowait: int = 0, guest: int = 0) -> bytes:
    return (f"cpu  {user} 0 0 {idle} {iowait} 0 0 0 {guest} 0\n"
            f"cpu0 {user} 0 0 {idle} {iowait} 0 0 0 {guest} 0\ncpu1 0 0 0 0 0 0 0 0 0 0\n"
            "intr 1 2 3\nctxt 42\n").encode()


MEMINFO = b"""MemTotal:        2000000 kB
MemFree:          500000 kB
MemAvailable:    1500000 kB
Buffers:          100000 kB
Cached:           300000 kB
SReclaimable:      50000 kB
"""


def test_cpu_count_and_times_come_from_proc_stat_without_guest_time_twice():
    count, times = read_proc_stat(proc_stat(user=30, idle=60, iowait=10, guest=5).decode())
    assert count == 2 and times == CpuTimes(total=100, busy=30)


def test_cpu_use_is_the_busy_share_between_readings_as_gopsutil_reckons_it():
    assert cpu_used_pct(CpuTimes(0, 0), CpuTimes(total=300, busy=100)) == 33.33
    assert cpu_used_pct(CpuTimes(300, 100), CpuTimes(total=400, busy=150)) == 50.0
    assert cpu_used_pct(CpuTimes(300, 100), CpuTimes(total=400, busy=100)) == 0.0  # idle, or counters rewound
    assert cpu_used_pct(CpuTimes(300, 100), CpuTimes(total=300, busy=120)) == 100.0


def test_memory_is_read_as_gopsutil_reads_it():
    assert read_meminfo(MEMINFO.decode()) == Memory(
        total=2_000_000 * 1024, cache=350_000 * 1024, used=(2_000_000 - 500_000 - 100_000 - 350_000) * 1024
    )


class MeasuredRuntime(FakeRuntime):
    """Its guests' root filesystem: 10 GiB, 4 GiB of it no longer available."""

    async def fs(self, vm_id: str, op: str, **fields: Any) -> dict[str, Any]:
        self._agent_of(vm_id)
        assert op == "stat" and fields == {"path": "/", "filesystem": True}
        return {"entry": {}, "filesystem": {"total": 10 * GIB, "available": 6 * GIB}}


async def test_the_series_of_a_sandbox_is_sampled_in_its_guest_and_served_by_time_range(tmp_path):
    plane = ControlPlane(tmp_path, MeasuredRuntime())
    sampler = plane.app.state.metrics
    try:
        async with plane.http() as client:
            client.headers["X-API-KEY"] = plane.key_for("alice")
            sandbox_id = (await client.post(f"{E2B}/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
            paused_id = (await client.post(f"{E2B}/v2/sandboxes", json={"templateID": "base"})).json()["sandboxID"]
            await client.post(f"{E2B}/sandboxes/{paused_id}/pause")
            files = plane.runtime.host.vms[sandbox_id].files
            url = f"{E2B}/sandboxes/{sandbox_id}/metrics"
            assert (await client.get(url)).json() == []

            started = int(time.time())
            files.update({"/proc/stat": proc_stat(user=100, idle=300), "/proc/meminfo": MEMINFO})
            await sampler.sample_all()
            files["/proc/stat"] = proc_stat(user=150, idle=350)
            await sampler.sample_all()
            first, second = (await client.get(url)).json()
            assert first["cpuUsedPct"] == 25.0 and second["cpuUsedPct"] == 50.0
            assert second == {**second, "cpuCount": 2, "memTotal": 2_000_000 * 1024, "memCache": 350_000 * 1024,
                              "memUsed": 1_050_000 * 1024, "diskTotal": 10 * GIB, "diskUsed": 4 * GIB}
            assert started <= second["timestampUnix"] <= time.time() and second["timestamp"].endswith("Z")

            ranged = await client.get(url, params={"start": started, "end": int(time.time())})
            assert len(ranged.json()) == 2
            before = await client.get(url, params={"start": started - 3600, "end": started - 1800})
            assert before.json() == []
            assert (await client.get(url, params={"start": -1})).status_code == 400
            # Sampling a paused sandbox would wake it: it is left alone.
            paused = await client.get(f"{E2B}/sandboxes/{paused_id}/metrics")
            assert paused.json() == [] and plane.runtime.host.vms[paused_id].hibernated

            client.headers["X-API-KEY"] = plane.key_for("bob")
            assert (await client.get(url)).status_code == 404  # not bob's
            client.headers["X-API-KEY"] = plane.key_for("alice")
            await client.delete(f"{E2B}/sandboxes/{sandbox_id}")
            await sampler.sample_all()
            assert (await client.get(url)).status_code == 404 and sampler.series(sandbox_id, start=None, end=None) == []
    finally:
        await plane.close()
