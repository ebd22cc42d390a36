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


# A process that holds a random token in its memory only, and writes it out when asked:
# the token can only come back if the process's memory does.
KEEPER = r"""
import os, secrets, time
token = secrets.token_hex(16)
while True:
    if os.path.exists("/tmp/ask"):
        os.unlink("/tmp/ask")
        with open("/tmp/token.part", "w") as out:
            out.write(token)
        os.replace("/tmp/token.part", "/tmp/token")
    time.sleep(0.02)
"""


async def start_keeper(runtime, vm_id: str) -> str:
    async def one_chunk():
        yield KEEPER.encode()

    await runtime.write_file(vm_id, "/home/boxd/keeper.py", one_chunk())
    return await sh(runtime, vm_id, "nohup python3 /home/boxd/keeper.py >/dev/null 2>&1 & echo $!")


async def token_of(runtime, vm_id: str) -> str:
    """What the keeper holds in memory now (it writes it out only when asked)."""
    return await sh(
        runtime, vm_id, "rm -f /tmp/token; touch /tmp/ask; while [ ! -s /tmp/token ]; do sleep 0.05; done; cat /tmp/token"
    )
