"""Serving iterations from requests and their arrivals, batched two ways.

- "continuous": iteration-level continuous batching (twin/iterations.compose_iterations):
  arrived requests join the running batch (up to max_batch); an iteration with newcomers is their
  prefill, otherwise every running request decodes one token.
- "per-second": the paper's batching. Requests arriving within the same second (counted from the first
  arrival) form one batch (a second with more than max_batch arrivals makes several). A batch
  starts when its second has closed and the previous batch has finished: one prefill iteration of
  all its prompts, then decode iterations until its last request is done (finished ones leave).

Both advance the clock one fixed step per iteration (step_s) and jump over idle time.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moeless.twin.iterations import Iteration, RequestLoads, compose_iterations

BATCHING = ("continuous", "per-second")


def compose(mode: str, requests: Sequence[RequestLoads], arrivals: np.ndarray, step_s: float, max_batch: int,
            max_iterations: int) -> list[Iteration]:
    """Iterations in time order under batching `mode`; request i of the arrivals replays
    requests[i % len(requests)]."""
    if mode == "continuous":
        return compose_iterations(requests, arrivals, step_s, max_batch, max_iterations)
    if mode == "per-second":
        return per_second(requests, arrivals, step_s, max_batch, max_iterations)
    raise ValueError(f"unknown batching {mode!r}; use one of {', '.join(BATCHING)}")


def per_second(requests: Sequence[RequestLoads], arrivals: np.ndarray, step_s: float, max_batch: int,
               max_iterations: int) -> list[Iteration]:
    """The paper's batching (see the module docstring). arrivals: [N] seconds, non-decreasing."""
    if not requests:
        raise ValueError("need at least one request's loads")
    if step_s <= 0 or max_batch <= 0 or max_iterations <= 0:
        raise ValueError("step_s, max_batch and max_iterations must be positive")
    arrivals = np.asarray(arrivals, dtype=np.float64)
    shape = np.asarray(requests[0].prefill).shape
    second = np.floor(arrivals - arrivals[0]).astype(np.int64)
    out: list[Iteration] = []
    now = float(arrivals[0])
    # 1. Batches: consecutive arrivals of one second, at most max_batch each.
    starts = np.flatnonzero(np.diff(second, prepend=-1))
    for first, end in zip(starts, [*starts[1:], len(arrivals)]):
        for lo in range(first, end, max_batch):
            batch = list(range(lo, min(lo + max_batch, end)))
            if len(out) >= max_iterations:
                return out
            # 2. The batch starts once its second has closed and the previous batch is done.
            now = max(now, float(arrivals[0] + second[lo] + 1))
            load = sum(np.asarray(requests[i % len(requests)].prefill, dtype=np.int64) for i in batch)
            out.append(Iteration("prefill", load.reshape(shape), len(batch), tuple((i, -1) for i in batch), now))
            now += step_s
            # 3. Decode until the batch's last request is done.
            running = [[i, 0] for i in batch if len(requests[i % len(requests)].decode)]
            while running and len(out) < max_iterations:
                load = np.zeros(shape, dtype=np.int64)
                for slot in running:
                    load += np.asarray(requests[slot[0] % len(requests)].decode[slot[1]], dtype=np.int64)
                out.append(Iteration("decode", load, len(running), tuple((i, s) for i, s in running), now))
                for slot in running:
                    slot[1] += 1
                running = [s for s in running if s[1] < len(requests[s[0] % len(requests)].decode)]
                now += step_s
    return out
