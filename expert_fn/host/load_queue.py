"""The expert host's load workers: a call's loads before prefetches, each kind in arrival order.

A call that needs a replica not resident waits for its load (a cold start); a prefetch (the planning
loop's Load RPCs, a waking model's wake set: runtime.py) waits for nobody. With one first-in,
first-out queue a call's load waits behind every prefetch queued before it: a fine-tune waking on a
one-GPU pool queued all its own experts and then waited for the last layer's before its first
layer's routed one. So `submit(..., urgent=True)` (a call's) runs before every prefetch not started
yet, and `hurried` moves a queued prefetch that a call now needs up to a call's place. A load that
has started runs to its end; the workers are the host's load_workers.

    queue = LoadQueue(2, "expert-load")
    later = queue.submit(load, key_a, urgent=False)   # a prefetch
    now = queue.submit(load, key_b, urgent=True)      # a call's: taken before key_a if key_a waits
    queue.hurried(later, True)                        # a call needs key_a too: a call's place
"""

from __future__ import annotations

import heapq
import itertools
import threading
from concurrent.futures import Future
from typing import Any, Callable

URGENT, PREFETCH = 0, 1


class LoadQueue:
    """Worker threads that run submitted functions, urgent ones first (module docstring). Thread-safe."""

    def __init__(self, workers: int, name: str):
        self._heap: list[tuple[int, int, dict]] = []  # (priority, arrival, job); a hurried job is in twice
        self._jobs: dict[Future, dict] = {}  # queued, not taken yet
        self._arrival = itertools.count()
        self._ready = threading.Condition()
        self._closed = False
        self._threads = [threading.Thread(target=self._work, name=f"{name}-{i}", daemon=True) for i in range(workers)]
        for thread in self._threads:
            thread.start()

    def submit(self, fn: Callable[..., Any], *args: Any, urgent: bool = False) -> Future:
        """fn(*args) on a worker, a call's (urgent) before every prefetch not started yet."""
        future: Future = Future()
        job = {"fn": fn, "args": args, "future": future}
        with self._ready:
            if self._closed:
                raise RuntimeError("the load queue is shut down")
            self._jobs[future] = job
            heapq.heappush(self._heap, (URGENT if urgent else PREFETCH, next(self._arrival), job))
            self._ready.notify()
        return future

    def hurried(self, future: Future, urgent: bool) -> Future:
        """future, its job moved to a call's place if `urgent` and it has not started (else as it is)."""
        with self._ready:
            job = self._jobs.get(future)
            if urgent and job is not None:
                heapq.heappush(self._heap, (URGENT, next(self._arrival), job))
                self._ready.notify()
        return future

    def shutdown(self, wait: bool = True, cancel_futures: bool = False) -> None:
        """No more submits; the jobs not started cancelled (cancel_futures) or run; wait for the workers."""
        with self._ready:
            self._closed = True
            if cancel_futures:
                for job in self._jobs.values():
                    job["future"].cancel()
                self._heap, self._jobs = [], {}
            self._ready.notify_all()
        if wait:
            for thread in self._threads:
                thread.join()

    def _work(self) -> None:
        while True:
            with self._ready:
                while not self._heap and not self._closed:
                    self._ready.wait()
                if not self._heap:
                    return
                _, _, job = heapq.heappop(self._heap)
                if self._jobs.pop(job["future"], None) is None:
                    continue  # hurried: taken from its other place already
            future = job["future"]
            if not future.set_running_or_notify_cancel():
                continue
            try:
                future.set_result(job["fn"](*job["args"]))
            except BaseException as err:  # the caller's future carries it (as ThreadPoolExecutor does)
                future.set_exception(err)
