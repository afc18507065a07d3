"""The host's load workers (expert_fn/host/load_queue.py): a call's loads before prefetches, a queued
prefetch a call needs moved up once and run once, the queue shut down with what it holds cancelled."""

from __future__ import annotations

import threading

import pytest

from moeless.expert_fn.host.load_queue import LoadQueue


def _blocked(queue: LoadQueue) -> tuple[threading.Event, list[str]]:
    """The queue's one worker held by a first job until the event is set; `ran` records the order."""
    gate, started, ran = threading.Event(), threading.Event(), []

    def hold() -> None:
        started.set()
        assert gate.wait(10.0)

    queue.submit(hold)
    assert started.wait(10.0)
    return gate, ran


def test_a_calls_load_runs_before_the_prefetches_queued_before_it():
    queue = LoadQueue(1, "test")
    gate, ran = _blocked(queue)
    futures = [queue.submit(ran.append, name, urgent=name.startswith("call")) for name in ("prefetch-a", "prefetch-b", "call-c")]
    gate.set()
    for f in futures:
        f.result(10.0)
    assert ran == ["call-c", "prefetch-a", "prefetch-b"]
    queue.shutdown()


def test_a_queued_prefetch_a_call_needs_moves_up_and_runs_once():
    queue = LoadQueue(1, "test")
    gate, ran = _blocked(queue)
    a, b = (queue.submit(ran.append, name) for name in ("prefetch-a", "prefetch-b"))
    assert queue.hurried(b, True) is b and queue.hurried(a, False) is a  # not urgent: stays where it is
    gate.set()
    a.result(10.0), b.result(10.0)
    queue.shutdown()
    assert ran == ["prefetch-b", "prefetch-a"]


def test_failures_reach_the_future_and_shutdown_cancels_what_has_not_started():
    queue = LoadQueue(1, "test")
    failing = queue.submit(lambda: 1 / 0, urgent=True)
    with pytest.raises(ZeroDivisionError):
        failing.result(10.0)
    gate, ran = _blocked(queue)
    waiting = queue.submit(ran.append, "never")
    queue.shutdown(wait=False, cancel_futures=True)
    gate.set()
    queue.shutdown()  # the worker finishes the job it holds and stops
    assert waiting.cancelled() and ran == []
    with pytest.raises(RuntimeError, match="shut down"):
        queue.submit(ran.append, "late")
