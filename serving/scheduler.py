"""Continuous batching: iteration-level scheduling of generation requests over one Engine.

`Scheduler.step()` is the one place where an iteration's forwards run:

1. admit: waiting requests join, first come first served, while the running requests stay
   under `max_running` and the iteration's tokens (each newcomer's prompt + one per running
   request) under `max_tokens_per_iteration` (`admit`, a pure function); with a step gate
   (serving/step_gate.py), the newcomers wait out of the batch until the placement spans the
   hosts their step needs, while the running requests go on;
2. prefill the newcomers together (one forward, prompts packed without padding): each gets its
   first token;
3. decode every running request (one forward over KVSlots): each gets its next token;
4. newcomers that go on take a KV row; requests that ended (EOS, max_tokens, cancelled) leave.

So a request joins at the next iteration and leaves when it ends, nobody waits for the longest
request of a batch, and an iteration's time is bounded by the token cap. Admission bounds TTFT:
at most `max_waiting` requests queue (more get a 429 at once, `server_busy`), and each waits
only for rows to free up, never for a whole batch. Events go to each request's `sink` once per
iteration, in the format of moeless.serving.engine.

`drain()` stops admitting (new requests: 503 `shutting_down`; queued ones are told the same)
and lets running requests finish; `abort(message)` ends the rest with a 503 at the next step.
`SchedulerLoop` steps a scheduler on its own thread whenever there is work.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Sequence

from moeless.serving.api import ApiError, GenerationRequest
from moeless.serving.codec import TextStream
from moeless.serving.engine import Engine, error_event
from moeless.serving.kv_slots import KVSlots

log = logging.getLogger(__name__)

Sink = Callable[[list[dict]], None]  # receives one iteration's events of one request


@dataclass(frozen=True)
class BatchLimits:
    """The caps of continuous batching (a ModelServer replica's)."""

    max_running: int = 64  # requests decoding together (KV rows)
    max_tokens_per_iteration: int = 512  # newcomers' prompt tokens + one per running request
    max_waiting: int = 256  # queued requests; more are refused with a 429

    def __post_init__(self):
        for name in ("max_running", "max_tokens_per_iteration"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be at least 1, got {getattr(self, name)}")
        if self.max_waiting < 0:
            raise ValueError(f"max_waiting must be >= 0, got {self.max_waiting}")


def admit(waiting: Sequence[int], running: int, limits: BatchLimits) -> int:
    """How many waiting requests (their prompt lengths, in arrival order) join this iteration.

    First come first served, while rows and the iteration's token budget allow; the head of the
    queue always joins when a row is free, so a prompt longer than the budget is not starved
    (it is prefilled with no other newcomer).
    """
    budget = limits.max_tokens_per_iteration - running
    count = 0
    for length in waiting:
        if running + count >= limits.max_running or (count and length > budget):
            break
        budget -= length
        count += 1
    return count


@dataclass
class _Request:
    rid: int
    request: GenerationRequest
    prompt: list[int]
    sink: Sink
    stream: TextStream
    arrived: float
    token: int = -1  # the last generated token (the next decode's input)
    events: list[dict] = field(default_factory=list)
    done: bool = False


@dataclass
class SchedulerStats:
    """Counters for /metrics and benchmarks (seconds are wall time of step())."""

    iterations: int = 0
    prefill_tokens: int = 0
    decode_tokens: int = 0
    busy_s: float = 0.0
    refused: int = 0


class Scheduler:
    """Iteration-level scheduler over `engine` (thread-safe submit/cancel; one thread steps)."""

    def __init__(self, engine: Engine, limits: BatchLimits = BatchLimits(), clock: Callable[[], float] = time.monotonic,
                 gate=None):
        self.engine = engine
        self.limits = limits
        self.gate = gate  # serving/step_gate.StepGate, or None: admit as the limits allow
        self.clock = clock
        self.stats = SchedulerStats()
        self.slots = KVSlots(len(engine.model.hf.model.layers), limits.max_running)
        self._running: dict[int, _Request] = {}
        self._waiting: deque[_Request] = deque()
        self._cancelled: set[int] = set()
        self._ids = itertools.count()
        self._lock = threading.Lock()
        self._work = threading.Condition(self._lock)
        self._draining = False
        self._abort: str | None = None

    # --- the requests' side (any thread) -----------------------------------------------------

    def submit(self, request: GenerationRequest, sink: Sink) -> int:
        """Queue a request; its events go to sink. Raises ApiError: 400 (prompt), 429 (queue
        full), 503 (draining)."""
        prompt = self.engine.encode(request)
        with self._lock:
            if self._draining:
                raise ApiError(503, "the server is shutting down; retry on another replica", code="shutting_down")
            if len(self._waiting) >= self.limits.max_waiting:
                self.stats.refused += 1
                raise ApiError(429, f"the server is at capacity ({len(self._running)} requests running, "
                                    f"{len(self._waiting)} waiting); retry later", code="server_busy")
            rid = next(self._ids)
            self._waiting.append(_Request(rid, request, prompt, sink, TextStream(self.engine.codec), self.clock()))
            self._work.notify_all()
        return rid

    def cancel(self, rid: int) -> None:
        """Drop a request (its client went away) at the next iteration."""
        with self._lock:
            self._cancelled.add(rid)
            self._work.notify_all()

    def counts(self) -> dict[str, int]:
        with self._lock:
            return {"running": len(self._running), "waiting": len(self._waiting)}

    # --- the stepping thread -----------------------------------------------------------------

    def wait_for_work(self, timeout_s: float) -> bool:
        """Block until some request waits or runs (or timeout); returns whether there is work."""
        with self._lock:
            return self._work.wait_for(lambda: self._waiting or self._running or self._cancelled or self._abort,
                                       timeout_s)

    def _owners(self, requests: list[_Request]) -> list[int] | None:
        """Each request's member of the engine's family (serving/family.py); None for an engine of one model."""
        members = getattr(self.engine, "members", None)
        return [self.engine.owner(r.request.model) for r in requests] if members else None

    def step(self) -> None:
        """One iteration (see the module docstring)."""
        start = time.perf_counter()
        # 1. An abort, cancellations, then admission.
        if self._abort is not None:
            self._fail_running()
        with self._lock:
            self._drop_cancelled()
            count = admit([len(r.prompt) for r in self._waiting], len(self._running), self.limits)
            tokens = len(self._running) + sum(len(self._waiting[i].prompt) for i in range(count))
            gated = bool(count) and self.gate is not None
            models = {r.request.model for r in (*self._running.values(), *itertools.islice(self._waiting, count))} if gated else ()
        held = gated and not self.gate.admit(tokens, count, models)  # may ask the loop: unlocked
        with self._lock:
            newcomers = [] if held else [self._waiting.popleft() for _ in range(min(count, len(self._waiting)))]
            rows = [self._running[rid] for rid in self.slots.rids]
            if held and not rows:  # nothing to step while the placement widens: wait a tick, not spin
                self._work.wait(0.002)
                return
        batch = len(rows) + len(newcomers)
        # 2. Prefill the newcomers: their first token.
        kv: list = []  # per newcomer: (the cache holding its KV in row 0, where its columns start)
        if newcomers:
            try:
                tokens, kv = self.engine.prefill([r.prompt for r in newcomers], self._owners(newcomers))
                for r, token in zip(newcomers, tokens):
                    r.events.append({"batch": batch})
                    self._push(r, token)
                self.stats.prefill_tokens += sum(len(r.prompt) for r in newcomers)
            except Exception as err:  # the forward failed: these requests fail, the others go on
                for r in newcomers:
                    self._fail(r, err)
        # 3. Decode every running request.
        if rows:
            try:
                for r, token in zip(rows, self.engine.decode(self.slots, [r.token for r in rows], self._owners(rows))):
                    self._push(r, token)
                self.stats.decode_tokens += len(rows)
            except Exception as err:  # a failed decode fails every running request
                for r in rows:
                    self._fail(r, err)
        # 4. Newcomers that go on take a row; finished requests leave; events go out.
        with self._lock:
            for r, (cache, column) in zip(newcomers, kv):
                if not r.done:
                    self.slots.add(r.rid, cache, 0, column, len(r.prompt))
                    self._running[r.rid] = r
            for r in rows:
                if r.done:
                    self._leave(r)
            self.stats.iterations += 1
            self.stats.busy_s += time.perf_counter() - start
        for r in rows + newcomers:
            self._flush(r)

    def drain(self) -> None:
        """Stop admitting: new requests get a 503, queued ones are told so now."""
        with self._lock:
            self._draining = True
            waiting, self._waiting = list(self._waiting), deque()
        for r in waiting:
            self._fail(r, ApiError(503, "the server is shutting down before this request started; retry "
                                        "on another replica", code="shutting_down"))
            self._flush(r)

    def reset(self, err: Exception) -> None:
        """Fail every request (running and queued) with err and start over with empty KV rows:
        what the loop does when a step fails outside a forward (a bug), instead of hanging them."""
        with self._lock:
            requests = list(self._running.values()) + list(self._waiting)
            self._running, self._waiting = {}, deque()
            self.slots = KVSlots(self.slots.num_layers, self.limits.max_running, self.slots.min_capacity)
        for r in requests:
            self._fail(r, err)
            self._flush(r)

    def abort(self, message: str) -> None:
        """End every running request with a 503 saying `message`, at the next step."""
        with self._lock:
            self._abort = message
            self._work.notify_all()

    def _fail_running(self) -> None:
        with self._lock:
            rows, message, self._abort = list(self._running.values()), self._abort, None
            for r in rows:
                self._leave(r)
        for r in rows:
            self._fail(r, ApiError(503, message, code="shutting_down"))
            self._flush(r)

    # --- internals ---------------------------------------------------------------------------

    def _push(self, r: _Request, token: int) -> None:
        """Record r's new token as events; mark r done at EOS or max_tokens."""
        r.token = token
        generated = len(r.stream.ids) + 1
        finish = self.engine.finish_reason(token, generated, r.request.max_tokens)
        if finish != "stop":
            piece = r.stream.push(token)
            if piece:
                r.events.append({"text": piece})
        if finish:
            r.events.append({"finish": finish, "prompt_tokens": len(r.prompt), "completion_tokens": len(r.stream.ids)})
            r.done = True

    def _fail(self, r: _Request, err: Exception) -> None:
        r.events.append(error_event(err))
        r.done = True

    def _flush(self, r: _Request) -> None:
        if r.events:
            events, r.events = r.events, []
            try:
                r.sink(events)
            except Exception:  # the receiver is gone (its client disconnected): stop generating
                self.cancel(r.rid)

    def _leave(self, r: _Request) -> None:
        """Under the lock: r gives back its row."""
        self._running.pop(r.rid, None)
        if r.rid in self.slots.rids:
            self.slots.remove(r.rid)

    def _drop_cancelled(self) -> None:
        """Under the lock: cancelled requests leave the queue or their row."""
        for rid in self._cancelled:
            if rid in self._running:
                self._leave(self._running[rid])
        self._waiting = deque(r for r in self._waiting if r.rid not in self._cancelled)
        self._cancelled.clear()


class SchedulerLoop:
    """Steps `scheduler` on a daemon thread (with `threads` torch threads) while there is work."""

    def __init__(self, scheduler: Scheduler, threads: int = 1):
        self.scheduler = scheduler
        self.threads = threads
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="scheduler", daemon=True)
        self._thread.start()

    def stop(self, timeout_s: float = 30.0) -> None:
        self._stop.set()
        self._thread.join(timeout_s)

    def _run(self) -> None:
        import torch

        torch.set_num_threads(self.threads)  # OpenMP's thread count is per thread
        while not self._stop.is_set():
            if self.scheduler.wait_for_work(0.2):
                try:
                    self.scheduler.step()
                except Exception as err:  # never leave clients waiting on a dead loop
                    log.exception("scheduler step failed; failing the requests in flight")
                    self.scheduler.reset(err)
