"""Admission under a step SLO: the step scaler's serving half (its rules: controller/planning/step_scaler.py).

Before the scheduler admits newcomers (serving/scheduler.py), the gate prices the batch they would
form with the running requests (step_expert_s over the loop's cost profile, times the loop's refit of
it to the running machine, read by a thread of its own: FittedPrice) and asks for the fewest
hosts that run it within the step SLO (hosts_for_step; in a family engine the least SLO of the
fine-tunes in the batch, each its own or the engine's: the twin's step_floor). Where the loop plans over fewer, it asks
the loop to widen (PlanLoop.widen: a placement over that many ready hosts made resident on them,
by widen itself or else by planning passes) and holds the newcomers out -- the running requests
keep stepping on the placement they have -- until this replica runs that placement (the one widen's
answer carries, adopted at once, its board publish under way; else its board version, the
BoardFollower hurried meanwhile), or max_wait_s has passed (then they go in: a late scaler costs longer steps, never a hang). While
batches need the width, the gate asks again every hold_s / 4, so the loop holds it (PlacementWidth).
Where the loop has a standby placement over that many hosts (held whole by them as its last pass
read them: controller/planning/widenings.py Widenings.standby, on the board), the gate switches this
replica to it at once (BoardFollower.switch) and holds nobody; the ask to the loop goes out as
well, so the loop holds the width and publishes the same placement in its turn.
With hold_newcomers False (`--step-admit now`) it asks the same but lets the newcomers in at once:
the steps until the widened placement runs are longer, and no newcomer, a waking fine-tune's first
request included, waits for the widening (the twin's ungated sized pool: docs/shared-pool.md).

The twin prices the same rule (twin/finetunes.py, "shared-keys-batched-gated"); each hold's length
is the newcomers' admission wait, the scaler's lag as serving has it (`stats`, /metrics,
`moeless bench step-scaler`).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Callable, Iterable, Mapping

import numpy as np
import ray

from moeless.controller.planning.step_scaler import hosts_for_step, step_expert_s

log = logging.getLogger(__name__)
RECENT = 256  # holds the percentiles are over (a long-running replica keeps no more)


@dataclass
class GateStats:
    """holds: admissions held; timeouts: holds ended by max_wait_s; widenings: asks to the loop;
    held_requests: newcomers the holds kept out; waits_s: the last RECENT holds' lengths (seconds), in order;
    switches: widenings this replica ran at once on a standby placement, switch_s: their seconds."""

    holds: int = 0
    timeouts: int = 0
    widenings: int = 0
    held_requests: int = 0
    waits_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))
    switches: int = 0
    switch_s: deque = field(default_factory=lambda: deque(maxlen=RECENT))

    def as_dict(self) -> dict:
        """The counts, the recent holds and their p50 / p99 / max."""
        waits = np.asarray(self.waits_s)
        pct = {f"wait_p{q}_s": float(np.percentile(waits, q)) if len(waits) else 0.0 for q in (50, 99)}
        return {"holds": self.holds, "timeouts": self.timeouts, "widenings": self.widenings,
                "held_requests": self.held_requests, "wait_max_s": float(waits.max(initial=0.0)), **pct,
                "waits_s": waits.tolist(), "switches": self.switches, "switch_s": list(self.switch_s)}


class StepGate:
    """The gate (see the module docstring). price(tokens) -> expert host-seconds of a step (its `scale`,
    where it has one, FittedPrice's, shown in figures); slo_s: the
    step SLO, slos: a tighter or looser one per model of the engine (its fine-tunes), the least of those
    in a batch binding it;
    ready() -> ready hosts in the pool; widen(hosts) -> a Future of the loop's answer (the hosts it
    plans over, the board version to follow up to, a placement to run at once or None); seen() -> the board version this replica runs;
    hurry(seconds): follow the board closely meanwhile; switch(hosts, seconds) -> whether this replica
    now runs a standby placement over at least `hosts` hosts (no narrower one for that long);
    adopt(placement, seconds) -> whether it runs the placement the loop's answer carried, likewise."""

    def __init__(self, price: Callable[[int], float], slo_s: float, ready: Callable[[], int],
                 widen: Callable[[int], Future], seen: Callable[[], int], *,
                 hurry: Callable[[float], None] | None = None, switch: Callable[[int, float], bool] | None = None,
                 adopt: Callable[[object, float], bool] | None = None, slos: Mapping[str, float] | None = None,
                 hold_s: float = 2.0, max_wait_s: float = 2.0, hold_newcomers: bool = True,
                 clock: Callable[[], float] = time.monotonic):
        self.slos = dict(slos or {})
        if not slo_s > 0 or not max_wait_s >= 0 or not all(v > 0 for v in self.slos.values()):
            raise ValueError(f"a step gate needs step SLOs > 0 s and a max wait >= 0 s, got {slo_s}, {self.slos}, "
                             f"{max_wait_s}")
        self.price, self.slo_s, self.ready, self.widen, self.seen = price, slo_s, ready, widen, seen
        self.hurry = hurry or (lambda for_s: None)
        self.switch = switch or (lambda hosts, for_s: False)
        self.adopt = adopt or (lambda placement, for_s: False)
        # the loop holds a width hold_s after its last need: asked again every renew_s while needed
        self.hold_s, self.renew_s, self.max_wait_s, self.clock = hold_s, hold_s / 4, max_wait_s, clock
        self.hold_newcomers = hold_newcomers
        self.stats = GateStats()
        self.granted, self.version, self.renewed = 1, 0, -float("inf")  # the loop's last answer, when asked
        self.asking: tuple[int, Future, bool] | None = None  # (hosts, the answer to come, switched to them)
        self.held_since: float | None = None
        self._lock = threading.Lock()  # stats are read by /metrics

    def admit(self, tokens: int, newcomers: int, models: Iterable[str] = ()) -> bool:
        """Whether `newcomers` may join a step of `tokens` tokens in all (their prompts and one per
        running request) of `models` (the step's requests', newcomers included) now; False: hold them
        out of this step."""
        now = self.clock()
        if self.asking is not None and self.asking[1].done():
            self.granted, version, placement = self._answer(*self.asking[:2])
            ran = self.asking[2] or placement is not None and self.adopt(placement, self.max_wait_s)
            self.version = self.version if ran else version  # this replica runs it already: no board version to wait for
            self.asking = None
        if self.asking is None and now - self.renewed >= self.hold_s:
            self.granted = 1  # not asked for hold_s: the loop has narrowed since
        need = hosts_for_step(self.price(tokens), self.slo_for(models), self.ready())
        if self.asking is None and need > 1 and (need > self.granted or now - self.renewed >= self.renew_s):
            switched = need > self.granted and self._switch(need, now)
            self.asking, self.renewed = (need, self.widen(need), switched), now  # renewed while needed: held
            self.granted = need if switched else self.granted
            with self._lock:
                self.stats.widenings += 1
        waiting = self.asking is not None and self.asking[0] > self.granted
        if not self.hold_newcomers or not waiting and self.seen() >= self.version:
            self._end(now, newcomers, timed_out=False)
            return True
        if self.held_since is None:
            self.held_since = now
            self.hurry(self.max_wait_s)
        if now - self.held_since >= self.max_wait_s:
            self._end(now, newcomers, timed_out=True)
            return True
        return False

    def slo_for(self, models: Iterable[str]) -> float:
        """The step SLO of a batch of `models`' requests: the least of theirs (slo_s for one without its own)."""
        return min((self.slos.get(m, self.slo_s) for m in set(models)), default=self.slo_s)

    def _switch(self, need: int, now: float) -> bool:
        if not self.switch(need, self.max_wait_s):
            return False
        with self._lock:
            self.stats.switches += 1
            self.stats.switch_s.append(self.clock() - now)
        return True

    def _answer(self, asked: int, answer: Future) -> tuple[int, int, object]:
        try:
            hosts, version, placement = answer.result()
            return int(hosts), int(version), placement
        except Exception as err:  # the loop is gone or failing: serve on the placement there is, ask again later
            log.warning("the planning loop did not answer a widening to %d hosts: %s", asked, err)
            return asked, self.version, None

    def _end(self, now: float, newcomers: int, timed_out: bool) -> None:
        if self.held_since is None:
            return
        with self._lock:
            self.stats.holds += 1
            self.stats.timeouts += timed_out
            self.stats.waits_s.append(now - self.held_since)
            self.stats.held_requests += newcomers
        self.held_since = None

    def figures(self) -> dict:
        """The stats (GateStats.as_dict), the hosts the loop last granted, the SLOs, the price's scale."""
        with self._lock:
            return {**self.stats.as_dict(), "granted": self.granted, "slo_s": self.slo_s, "slos_s": dict(self.slos),
                    "price_scale": getattr(self.price, "scale", 1.0)}


class FittedPrice:
    """A step's expert host-seconds (step_expert_s over `profile` and the model's shape) times the
    loop's refitted compute scale (controller/planning/cost_fit.py: under load the idle calibration
    is 30-50% short, and the planners plan with the refit too). A thread of its own asks fetch() for
    the scale every refresh_s (start=False: the caller refreshes), so no step waits for the loop (asked
    on the step thread, it cost warm widenings up to 5 ms: docs/serving.md); a failed ask keeps the scale it had (1: the
    calibration, until the first answer)."""

    def __init__(self, profile, spec, fetch: Callable[[], float], refresh_s: float = 5.0, start: bool = True):
        self.profile, self.spec, self.fetch, self.refresh_s = profile, spec, fetch, refresh_s
        self.scale = 1.0
        self._failing = False  # the last ask failed: the next failures are not warned of again
        self._stop = threading.Event()
        if start:
            threading.Thread(target=self._run, name="step-price", daemon=True).start()

    def __call__(self, tokens: int) -> float:
        spec = self.spec
        return self.scale * step_expert_s(tokens, self.profile, spec.num_layers, spec.top_k, spec.num_experts)

    def refresh(self) -> None:
        """Ask the loop for its scale now; a failure is warned of once, until an ask succeeds again."""
        try:
            self.scale = float(self.fetch())
        except Exception as err:  # the loop is gone or failing: price as before, ask again later
            (log.debug if self._failing else log.warning)(
                "the planning loop did not give its cost scale (pricing at %.3gx the calibration until it does): %s",
                self.scale, err)
            self._failing = True
            return
        self._failing = False

    def close(self) -> None:
        self._stop.set()

    def _run(self) -> None:
        while True:
            self.refresh()
            if self._stop.wait(self.refresh_s):
                return


def step_gate_for(slo_s: float, profile, spec, pool, loop, follower, **options) -> StepGate:
    """The gate of a serving replica on the live loop (options: StepGate's, slos among them): priced by
    the loop's cost profile over the model's shape, refitted as the loop's is (FittedPrice), ready hosts
    from its pool, widened by `loop`, the widened placement read by its BoardFollower (hurried while a
    hold waits)."""
    return StepGate(FittedPrice(profile, spec, lambda: ray.get(loop.cost_scale.remote(), timeout=30)),
                    slo_s, lambda: len(pool.clients()), lambda hosts: loop.widen.remote(hosts).future(),
                    lambda: follower.seen, hurry=follower.hurry, switch=follower.switch,
                    adopt=follower.adopt, **options)
