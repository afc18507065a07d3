"""Recorded routing as the twin's workload: a request's token ranges as [L, E] loads for the
chunked scheduler (twin/chunked.py), from a routing file (traces/routing_file.py).
"""

from __future__ import annotations

import numpy as np

from moeless.traces.routing_file import Routing


def cumulative_counts(routing: Routing) -> list[np.ndarray]:
    """Per request r, [T_r + 1, L, E] int32: tokens per (layer, expert) among its first t tokens."""
    out = []
    for r in range(len(routing.lengths)):
        ids = routing.request(r)  # [T_r, L, k]
        onehot = np.zeros((len(ids), ids.shape[1], routing.num_experts), dtype=np.int32)
        t, l, _ = np.indices(ids.shape)
        np.add.at(onehot, (t.ravel(), l.ravel(), ids.ravel()), 1)
        out.append(np.concatenate([np.zeros((1, *onehot.shape[1:]), np.int32), np.cumsum(onehot, axis=0, dtype=np.int32)]))
    return out


def token_loads(cum: np.ndarray, start: int, count: int) -> np.ndarray:
    """[L, E] loads of tokens start..start+count-1 of a request whose routing has T tokens, cum:
    [T + 1, L, E] from cumulative_counts. Token t replays routed token t mod T (a workload request
    longer than the recorded one cycles through its routing)."""
    size = cum.shape[0] - 1
    if count <= 0:
        return np.zeros(cum.shape[1:], np.int64)

    def upto(n: int) -> np.ndarray:  # loads of tokens 0..n-1 under the cycling
        return (n // size) * cum[size].astype(np.int64) + cum[n % size]

    return upto(start + count) - upto(start)
