"""Ping-pong: two micro-batches in flight, so one's expert calls hide behind the other's attention.

A step's rows are split into micro-batches, each run in a thread of its own; a baton (a lock)
lets one of them compute at a time. A micro-batch gives the baton up while it waits for its expert
calls (`waiting()`, which RemoteExecutor enters around the wait) and takes it back to go on, so
while micro-batch A's calls are on the hosts, B runs its attention, norms and gate; then B's calls
go out and A gathers and goes on. The hosts serve one micro-batch's call at a time (the executor
holds a host from a call's submit until its answer is gathered), so the order on both sides stays
A, B, A, B.

    outputs = run_micro_batches([lambda: forward(half_a), lambda: forward(half_b)])

The baton also keeps the replica to one stream of torch work, as without micro-batches (two
forwards computing at once would split the replica's cores between them); only the gather of a
micro-batch's answers runs as soon as they are back, beside the other's work. Each thread takes
its caller's thread-local torch settings (no-grad, OpenMP threads). What it costs: each
micro-batch's layer call pays the call's fixed cost again, and the replica its per-forward cost;
twin/overlap.py models when that is worth it, `moeless bench serve` measures it.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Callable, Iterator, Sequence, TypeVar

import torch

T = TypeVar("T")

_local = threading.local()  # .baton: the lock this micro-batch's thread holds while it computes; .index: its place


@contextmanager
def waiting() -> Iterator[bool]:
    """Around a wait on remote work: a micro-batch thread lets the other one compute meanwhile
    (nothing happens in any other thread). Yields whether it handed the baton over."""
    baton = getattr(_local, "baton", None)
    if baton is None:
        yield False
        return
    baton.release()
    try:
        yield True
    finally:
        baton.acquire()


def micro_batch() -> int:
    """Which micro-batch of its step this thread runs (0, 1, ...); 0 outside micro-batches. Whoever
    keeps per-forward state (the live loop's forecasts and figures) keeps one per micro-batch."""
    return getattr(_local, "index", 0)


def check_split(micro_batches: int, micro_batch_tokens: int) -> None:
    """ValueError unless both are at least 1 (the engine's split rule, `Engine._parts`)."""
    if micro_batches < 1 or micro_batch_tokens < 1:
        raise ValueError(f"micro_batches and micro_batch_tokens must be >= 1, got {micro_batches} and "
                         f"{micro_batch_tokens}")


def split_rows(n: int, parts: int = 2) -> list[range]:
    """Rows 0..n-1 as up to `parts` consecutive ranges of near-equal size (no empty one)."""
    parts = max(1, min(parts, n))
    bounds = [n * i // parts for i in range(parts + 1)]
    return [range(lo, hi) for lo, hi in zip(bounds, bounds[1:])]


def split_by_weight(weights: Sequence[int], parts: int = 2) -> list[range]:
    """Items 0..len-1 as up to `parts` consecutive ranges whose weights (prompt lengths) are near
    equal: each cut falls where the running total passes its share (no empty range)."""
    total, n = sum(weights), len(weights)
    parts = max(1, min(parts, n))
    cuts, running, next_part = [0], 0, 1
    for i, w in enumerate(weights):
        running += w
        room = n - (i + 1)  # items left for the ranges still to come
        if next_part < parts and (running * parts >= total * next_part or room == parts - next_part):
            cuts.append(i + 1)
            next_part += 1
    cuts.append(n)
    return [range(lo, hi) for lo, hi in zip(cuts, cuts[1:])]


def run_micro_batches(work: Sequence[Callable[[], T]]) -> list[T]:
    """Run each callable in a thread of its own, one computing at a time (see the module
    docstring); their results in order. The first exception raised is raised here once all ended.
    One callable runs in this thread, as is."""
    if len(work) == 1:
        return [work[0]()]
    baton = threading.Lock()
    grad, threads = torch.is_grad_enabled(), torch.get_num_threads()
    results: list = [None] * len(work)
    errors: list[BaseException | None] = [None] * len(work)

    def run(i: int) -> None:
        torch.set_num_threads(threads)  # OpenMP's count is per thread
        with torch.set_grad_enabled(grad), baton:
            _local.baton, _local.index = baton, i
            try:
                results[i] = work[i]()
            except BaseException as err:  # handed to the caller
                errors[i] = err
            finally:
                _local.baton, _local.index = None, 0

    workers = [threading.Thread(target=run, args=(i,), name=f"micro-batch-{i}", daemon=True) for i in range(len(work))]
    for worker in workers:
        worker.start()
    for worker in workers:
        worker.join()
    for err in errors:
        if err is not None:
            raise err
    return results
