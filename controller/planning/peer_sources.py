"""Where a load copies its replica from: a peer host that holds it resident (expert_fn/host/peer_copy.py).

A plan or a widening loads replicas on hosts that lack them. Each load's source is another host
that holds the same (layer, expert) resident, the one given the fewest copies so far in this batch
(ties: the lowest slot), so that a scale-out's copies spread over the holders' links instead of
queueing on one; a replica that no other host holds is read from the loading host's store (None).
The loading host copies from the source only where its own host tier lacks the expert, and reads
its store where the copy fails, so a source that went stale since the loop read the hosts costs a
warning, never a load.

    resident = np.zeros((1, 2, 4), bool); resident[0, 1, :2] = True   # hosts 0 and 1 hold (0, 1)
    peer_sources([(0, 1, 2), (0, 1, 3), (0, 0, 3)], resident)          # -> [0, 1, None]
"""

from __future__ import annotations

from collections import Counter
from typing import Sequence

import numpy as np


def peer_sources(loads: Sequence[tuple[int, int, int]], resident: np.ndarray) -> list[int | None]:
    """The source slot of each load, None for its store.

    loads: (layer, expert, host) each; resident: bool [L, E, G], the replicas of live hosts as the
    loop last read them.
    """
    given: Counter[int] = Counter()
    sources: list[int | None] = []
    for layer, expert, host in loads:
        holders = [int(g) for g in np.flatnonzero(resident[layer, expert]) if g != host]
        if not holders:
            sources.append(None)
            continue
        source = min(holders, key=lambda g: (given[g], g))
        given[source] += 1
        sources.append(source)
    return sources
