"""Helpers for tests that drive real machines through the runtime."""

from __future__ import annotations

import asyncio

from boxd.runtime.interface import ExecRequest


async def sh(runtime, vm_id: str, command: str) -> str:
    """Run a shell command in the guest; its stdout, stripped. A non-zero exit fails the test."""
    events = [event async for event in runtime.exec(vm_id, ExecRequest(shell=command))]
    assert events[-1].exit_code == 0, (command, events)
    return b"".join(e.data for e in events if e.kind == "stdout").decode().strip()


async def fork_ready(runtime, source: str, new_id: str) -> str:
    await runtime.fork(source, [new_id])
    await runtime.wait_ready(new_id, timeout=60)
    return new_id


async def gather(*coroutines):
    """``asyncio.gather`` as a coroutine, for the test loop's ``run``."""
    return await asyncio.gather(*coroutines)
