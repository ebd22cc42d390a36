"""Idle machines: suspended after a while without activity, hibernated after a while more.

Activity is anything the daemon does for a machine (a command, a file, a fork, a
checkpoint, a request to its URL); work still in flight (a streaming command, an
upload) keeps it busy, and a busy machine is never idle. A machine asks for its own
limits when it is created; unset, the daemon's apply; 0 turns a step off.
"""

from __future__ import annotations

import collections
import contextlib
import time
from collections.abc import Iterator
from dataclasses import dataclass

from boxd.models import Machine, MachineState


@dataclass(frozen=True)
class IdlePolicy:
    # A rollout pool idles between batches: a suspended machine costs no CPU and wakes
    # in about a millisecond, a hibernated one gives its memory back.
    suspend_after_s: float = 120.0
    hibernate_after_s: float = 900.0  # counted from the suspension
    check_every_s: float = 1.0

    def step_due(self, machine: Machine, idle_s: float) -> MachineState | None:
        """What an idle machine should become now, if anything."""
        suspend = self.suspend_after_s if machine.suspend_after_s is None else machine.suspend_after_s
        hibernate = self.hibernate_after_s if machine.hibernate_after_s is None else machine.hibernate_after_s
        if machine.state in (MachineState.RUNNING, MachineState.PAUSED) and hibernate and idle_s >= suspend + hibernate:
            return MachineState.STOPPED
        if machine.state is MachineState.RUNNING and suspend and idle_s >= suspend:
            return MachineState.PAUSED
        return None


class Activity:
    """When each machine was last used, and how much work on it is in flight."""

    def __init__(self) -> None:
        self._last: dict[str, float] = {}
        self._busy: collections.Counter[str] = collections.Counter()

    def touch(self, machine_id: str) -> None:
        self._last[machine_id] = time.monotonic()

    def begin(self, machine_id: str) -> None:
        """Work on the machine started; it is not idle until the matching ``end``."""
        self._busy[machine_id] += 1

    def end(self, machine_id: str) -> None:
        self._busy[machine_id] -= 1
        self.touch(machine_id)

    @contextlib.contextmanager
    def busy(self, machine_id: str) -> Iterator[None]:
        self.begin(machine_id)
        try:
            yield
        finally:
            self.end(machine_id)

    def idle_for(self, machine_id: str) -> float:
        """Seconds since its last use (0 while busy); a machine not seen yet starts now."""
        if self._busy[machine_id] > 0:
            return 0.0
        return time.monotonic() - self._last.setdefault(machine_id, time.monotonic())

    def forget(self, machine_id: str) -> None:
        self._last.pop(machine_id, None)
        self._busy.pop(machine_id, None)
