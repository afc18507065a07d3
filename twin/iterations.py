"""Serving iterations composed from per-request routing loads and request arrivals.

A simple continuous-batching model: the clock advances one fixed step per iteration; requests
that have arrived join (up to max_batch running); an iteration with newcomers is a prefill of
their prompts (loads summed), otherwise a decode step in which every running request adds its
next decode row. Arrivals: twin/arrivals.py; the paper's per-second batching: twin/batching.py.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass
from typing import Protocol, Sequence

import numpy as np

class RequestLoads(Protocol):
    """Routing of one request: prefill: [L, E] tokens per expert; decode: [S, L, E], one row per generated token."""

    prefill: np.ndarray
    decode: np.ndarray


@dataclass(frozen=True)
class Iteration:
    """One forward pass of the batch: phase "prefill" or "decode", load: [L, E] tokens per expert.

    batch: requests in it; rows: what each contributed, (request, decode row), the row -1 for a
    prefill (request i replays requests[i % len(requests)]); time_s: when it starts.
    """

    phase: str
    load: np.ndarray
    batch: int
    rows: tuple[tuple[int, int], ...] = ()
    time_s: float = 0.0


def per_iteration(iterations: Sequence[Iteration], prefill: Sequence[np.ndarray], decode: Sequence[np.ndarray]) -> np.ndarray:
    """Any per-request quantity summed the way the iterations batch requests: [I, ...].

    prefill[r]: [...] of request r's prefill; decode[r]: [S_r, ...], one row per decode step.
    (With the requests' own loads this gives back every iteration's load.)
    """
    n = len(prefill)
    out = []
    for it in iterations:
        out.append(sum(np.asarray(prefill[i % n] if s < 0 else decode[i % n][s], dtype=np.float64) for i, s in it.rows))
    return np.stack(out)


def compose_iterations(
    requests: Sequence[RequestLoads], arrivals: np.ndarray, step_s: float, max_batch: int, max_iterations: int
) -> list[Iteration]:
    """Iterations in time order. Request i of the arrivals replays requests[i % len(requests)]."""
    if not requests:
        raise ValueError("need at least one request's loads")
    if step_s <= 0 or max_batch <= 0 or max_iterations <= 0:
        raise ValueError("step_s, max_batch and max_iterations must be positive")
    shape = np.asarray(requests[0].prefill).shape
    waiting = deque(range(len(arrivals)))
    running: list[list[int]] = []  # [request index, next decode row]
    out: list[Iteration] = []
    now = float(arrivals[0])
    while len(out) < max_iterations and (waiting or running):
        # 1. Admit arrived requests while the batch has room; idle time jumps to the next arrival.
        if not running and waiting and arrivals[waiting[0]] > now:
            now = float(arrivals[waiting[0]])
        admitted = []
        while waiting and arrivals[waiting[0]] <= now and len(running) + len(admitted) < max_batch:
            admitted.append(waiting.popleft())
        # 2. Newcomers make a prefill iteration; otherwise every running request decodes a token.
        if admitted:
            load = sum(np.asarray(requests[i % len(requests)].prefill) for i in admitted)
            out.append(Iteration("prefill", np.asarray(load, dtype=np.int64).reshape(shape), len(admitted), tuple((i, -1) for i in admitted), now))
            running.extend([i, 0] for i in admitted)
        else:
            load = np.zeros(shape, dtype=np.int64)
            rows = tuple((i, step) for i, step in running)
            for slot in running:
                load += np.asarray(requests[slot[0] % len(requests)].decode[slot[1]], dtype=np.int64)
                slot[1] += 1
            out.append(Iteration("decode", load, len(running), rows, now))
        running = [s for s in running if s[1] < len(requests[s[0] % len(requests)].decode)]
        now += step_s
    return out
