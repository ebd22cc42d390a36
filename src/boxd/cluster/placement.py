"""Where a new machine goes: best of K hosts by the memory they can still give."""

from __future__ import annotations

import random
from dataclasses import dataclass

# A host keeps this much of its memory for itself, beyond what its machines commit.
RESERVE_MIB = 512
BEST_OF = 2


@dataclass(frozen=True)
class HostLoad:
    """What a host agent reports of itself."""

    host: str  # the agent's name, "boxd-host-<node id>"
    node_id: str
    available_mib: int  # the host's MemAvailable
    committed_mib: int  # guest RAM of the machines it runs (they may not touch it all yet)
    total_mib: int
    machines: int

    @property
    def headroom_mib(self) -> int:
        """Memory a new machine may count on: what is free now, and never more than what
        is left once every machine there uses all of its RAM."""
        return min(self.available_mib, self.total_mib - self.committed_mib) - RESERVE_MIB


def candidates(loads: list[HostLoad], memory_mib: int, *, best_of: int = BEST_OF,
               rng: random.Random | None = None) -> list[HostLoad]:
    """The hosts to try, in order: the roomiest of ``best_of`` sampled first (sampling
    spreads a burst of creates instead of piling it on one host), then every other host
    that has room, roomiest first. Empty if none has room."""
    roomy = [load for load in loads if load.headroom_mib >= memory_mib]
    if not roomy:
        return []
    sample = (rng or random).sample(roomy, min(best_of, len(roomy)))
    first = max(sample, key=lambda load: (load.headroom_mib, -load.machines))
    rest = sorted((load for load in roomy if load is not first), key=lambda load: -load.headroom_mib)
    return [first, *rest]
