"""Where each expert lives: moeless's homes, moved where the gates' loads say a new pairing pays.

On fine-grained routing (docs/deployments.md, FLAME-MoE) which experts share a GPU decides most of
decode's time: copies cost a weight read each and 4-32 tokens an expert cannot pay for it, while a
better pairing of experts with GPUs costs nothing once loaded. Production EPLB (SGLang, vLLM)
re-pairs on the loads summed since its last rebalance, unconditionally. moeless does the same on
the loads its gates report and moves a layer only where the new pairing would have been faster on
the recent iterations, so a move made on noise does not cost time:

1. Statistics: every iteration's actual loads [L, E] (its gates' report: Planner.learn) summed
   since the last move, and the last max(windows) kept; where nothing reports (a bare `moeless plan`),
   the forecasts instead. (Summed history forecasts, tried first, chose worse homes on FLAME:
   their shares are a mean over both phases' iterations, not weighted by tokens as the loads are.)
2. On schedule (after `first` plans, then every `every`: PlannerConfig.home_moves_first and
   home_moves_every, 10 and 50 by default, the knob homeMovesEvery, 0: no more moves; production
   EPLB waits 50 and then 1000), the candidate homes
   are DeepSeek's EPLB packing with no redundant expert on the sums (`packed_homes`: E rounded up to
   a multiple of G slots, so every GPU gets E / G experts, heaviest first onto the lightest GPU),
   then improved on the kept iterations themselves (`swapped_homes`): at most SWAPS times, the swap
   of two experts on different GPUs that most lowers the mean over those iterations of the busiest
   GPU's share of its iteration's work (alpha * tokens + a call's overhead per expert called; each
   iteration's work counted as 1, so a decode iteration weighs as much as a prefill's) among the
   swaps that do not raise the mean of the busiest GPU's seconds (which prefills dominate, and step
   3 judges). The sums balance tokens over the window; the swaps balance each iteration (FLAME on
   8 x H100, the twin: 33% / 21% of the bound's gain in prefill / decode with the packing alone,
   48% / 24% with 16 swaps, 49% / 24% with the seconds' guard; Phi-3.5-MoE code on 8 x A6000,
   moeless and static EP alone on the cell: prefill -24.8% / -24.1% / -24.6% against static EP,
   decode -9.7% / -10.4% / -10.2%). "The kept iterations" are the last `window` of them: a chance
   fits one candidate per window of `windows` (the last 64 and 256 iterations) and uses the window
   whose candidates, timed on the iterations after each chance (loads they never saw), took least,
   its score decayed by WINDOW_MEMORY a chance (home_fits.chosen_window). FLAME's four request
   windows are a steady mixture the long window fits; real prompts drift (docs/deployments.md).
3. A layer moves only where the candidate's time with every token at home (`home_time`) is below
   the current homes' by MOVE_MARGIN, in the mean over the kept iterations.
   The live loop (PlannerConfig.home_moves_submit) computes step 2's candidate on a thread of its
   own and judges it at its first plan after (a DeepSeek-V3 of 58 layers on 64 GPUs would hold
   the loop about 45 s a chance on 2 cores with one window; a window's swaps weigh at most
   home_fits.FIT_SAMPLES iterations, so the two cost 1.6x one: 1.4 s against 0.8 s at 26 layers of
   64 experts on 8 GPUs); the twin and `moeless plan` compute it in place.
4. Behind serving (`add_moves`): a new home that is not resident loads with no tokens while the old
   one serves (`settle`; a move the layer's memory cannot hold is called off: `cancel`); once all
   of the layer's have landed they take the tokens and the old ones are released (`settle`, and
   Placement.release: evicted at once), so no call waits for a move and no move leaves a free copy.
5. A planner made while replicas are resident (a restarted loop) adopts the homes the hosts hold
   (`adopt`): an expert held only away from its home has its home there.

The functions over loads (the packing, the swaps, a layer's time at its homes, the window's choice)
are placement/home_fits.py's.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from moeless.placement.home_fits import (
    WINDOW_MEMORY,
    WINDOWS,
    candidate_homes,
    chosen_window,
    home_time,
    static_homes,
    window_seconds,
)
from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import LayerPlacement

log = logging.getLogger(__name__)

MOVE_MARGIN = 0.01  # a layer moves only where its homes would have saved this share of its time


@dataclass
class HomeMoves:
    """One planner's homes and their statistics (module docstring). Stateful: one per planner."""

    num_layers: int
    num_experts: int
    num_gpus: int
    first: int
    every: int
    submit: Callable[..., Any] | None = None  # runs a chance's candidate elsewhere: f, *args -> a future (plan_call)
    windows: tuple[int, ...] = WINDOWS  # the windows a chance fits candidates on (step 2); the longest is kept
    homes: np.ndarray = field(init=False)
    calls: int = field(default=0, init=False)
    learnt: int = field(default=0, init=False)  # iterations in the statistics
    adopted: int = field(default=0, init=False)  # homes taken from what the hosts held (adopt)
    moves: list = field(default_factory=list, init=False)  # (plan, layer, experts, s before, s after, samples);
    # a move called off: (plan, layer, 0, 0, 0, 0)
    _sum: np.ndarray = field(init=False)
    _samples: list = field(default_factory=list, init=False)
    _left: list = field(init=False)
    window: int = field(init=False)  # the kept iterations the last chance weighed (step 2)
    window_changes: list = field(default_factory=list, init=False)  # (plan, window, {window: its score, s})
    _computing: tuple | None = field(default=None, init=False)  # (the candidates' future, their samples)
    _tried: dict | None = field(default=None, init=False)  # the last chance's candidates: {window: [L, E]}
    _scores: dict = field(default_factory=dict, init=False)  # {window: its candidates' decayed seconds since (step 2)}
    _since: int = field(default=0, init=False)  # iterations learnt since the last chance (the newest of _samples)

    def __post_init__(self) -> None:
        if self.first < 1 or self.every < 0:
            raise ValueError(f"homes move after >= 1 call, every >= 0 (0: never); got {self.first}, {self.every}")
        if not self.windows or min(self.windows) < 1:
            raise ValueError(f"homes are fitted on windows of >= 1 iteration; got {self.windows}")
        self.homes = np.tile(static_homes(self.num_experts, self.num_gpus), (self.num_layers, 1))
        self.window = min(self.windows)
        self._sum = np.zeros((self.num_layers, self.num_experts))
        self._left = [set() for _ in range(self.num_layers)]

    def adopt(self, resident: np.ndarray) -> int:
        """The homes the hosts hold (resident: [L, E, G] bool, replicas loaded on live hosts), for
        homes made while replicas are resident (a restarted loop): an expert held elsewhere but not
        at its home has its home where it is held (of those GPUs the one with fewest homes, then the
        lowest), the old home left to release. Without it a restarted loop would load static EP's
        blocks back, undoing the moves made before it. Returns how many homes it adopted."""
        resident = np.asarray(resident, dtype=bool)
        if resident.shape != (self.num_layers, self.num_experts, self.num_gpus):
            raise ValueError(f"resident must be [L, E, G] = {self.homes.shape + (self.num_gpus,)}, got {resident.shape}")
        before = self.adopted
        for l in range(self.num_layers):
            count = np.bincount(self.homes[l], minlength=self.num_gpus)
            away = ~resident[l, np.arange(self.num_experts), self.homes[l]] & resident[l].any(axis=1)
            for e in np.flatnonzero(away):
                gpus = np.flatnonzero(resident[l, e])
                g = int(gpus[np.argmin(count[gpus])])
                count[self.homes[l, e]] -= 1
                count[g] += 1
                self._left[l].add((int(e), int(self.homes[l, e])))
                self.homes[l, e] = g
                self.adopted += 1
        return self.adopted - before

    def fits(self, num_layers: int, num_experts: int, num_gpus: int) -> bool:
        return (self.num_layers, self.num_experts, self.num_gpus) == (num_layers, num_experts, num_gpus)

    def learn(self, loads: np.ndarray) -> None:
        """Step 1 for one iteration's loads [L, E] (actual: what its gates reported)."""
        self._sum += loads
        keep = max(self.windows)
        self._samples = [*self._samples[-(keep - 1):], np.asarray(loads, dtype=np.float64)]
        self._since += 1
        self.learnt += 1

    def plan_call(self, model: LatencyModel) -> np.ndarray:
        """Steps 2-3 at one plan (a move judged by `model`'s layer time): the homes [L, E] to plan on.
        With `submit` (the live loop's), a due chance's candidate is computed by it and judged at the
        first plan after it is done; a chance due while one computes is skipped."""
        self.calls += 1
        due = self.every and self.calls > self.first and (self.calls - 1 - self.first) % self.every == 0
        if self._computing is not None and self._computing[0].done():
            pending, samples = self._computing
            self._computing = None
            try:
                candidates = pending.result()
            except Exception:  # a chance lost, logged: the homes stay as they are
                log.exception("the homes' candidate judged at plan %d failed", self.calls)
            else:
                self._judge(candidates, samples, model)
        if due and self._samples and self._computing is None:
            sums, samples = self._sum.copy(), np.stack(self._samples, axis=1)  # [L, E], [L, S, E]
            self._sum[:] = 0.0
            self._choose(model)
            if self.submit is None:
                self._judge(candidate_homes(sums, samples, self.num_gpus, model, self.windows), samples, model)
            else:
                self._computing = (self.submit(candidate_homes, sums, samples, self.num_gpus, model, self.windows),
                                   samples)
        return self.homes

    @property
    def computing(self) -> bool:
        """A chance's candidate is being computed elsewhere (submit)."""
        return self._computing is not None and not self._computing[0].done()

    def _choose(self, model: LatencyModel) -> None:
        """Step 2's choice of window, on the last chance's candidates and the loads learnt since."""
        if self._tried is not None and self._since:
            since = np.stack(self._samples[-min(self._since, len(self._samples)):], axis=1)  # [L, S', E]
            took = window_seconds(self._tried, since, self.num_gpus, model)
            self._scores = {w: WINDOW_MEMORY * self._scores.get(w, 0.0) + t for w, t in took.items()}
            window = chosen_window(self._scores, self.window)
            if window != self.window:
                self.window_changes.append((self.calls, window, dict(self._scores)))
            self.window = window
        self._tried, self._since = None, 0

    def _judge(self, candidates: dict[int, np.ndarray], samples: np.ndarray, model: LatencyModel) -> None:
        """Step 3: each layer of the chosen window's candidate [L, E] whose homes would have been faster
        on that window's samples [L, S, E] by MOVE_MARGIN moves; every window's candidate is kept for
        the next chance's choice (_choose)."""
        self._tried = candidates
        candidate, samples = candidates[self.window], samples[:, -self.window:]
        for l in np.flatnonzero((candidate != self.homes).any(axis=1)):
            now = home_time(samples[l], self.homes[l], self.num_gpus, model)
            then = home_time(samples[l], candidate[l], self.num_gpus, model)
            if then < (1.0 - MOVE_MARGIN) * now:
                changed = np.flatnonzero(candidate[l] != self.homes[l])
                back = {(e, g) for e, g in self._left[l] if candidate[l, e] == g}  # moved back: a home again
                self._left[l] = (self._left[l] - back) | {(int(e), int(self.homes[l, e])) for e in changed}
                self.homes[l] = candidate[l]
                self.moves.append((self.calls, int(l), changed.size, now, then, samples.shape[1]))

    def describe(self) -> list[str]:
        """One line per move made: when, which layer, and why (`moeless plan` prints them)."""
        start = (f"{self.adopted} experts' homes where the hosts held them" if self.adopted else "static EP's blocks")
        if not self.moves and not self.every:
            return [f"homes: {start} (moves off: homeMovesEvery 0)"]
        if not self.moves:
            return [f"homes: {start} (no move paid by {MOVE_MARGIN:.0%} after {self.calls} plans)"]
        adopted = [f"homes at start: {start}"] if self.adopted else []
        windows = [f"homes fitted on the last {w} iterations from plan {k}: each window's candidates timed on the "
                   f"iterations after them (the layers' seconds, summed, {WINDOW_MEMORY:g} x the earlier chances'): "
                   + ", ".join(f"{v} iterations' {t * 1e6:.1f} us" for v, t in scores.items())
                   for k, w, scores in self.window_changes]
        return adopted + windows + [f"layer {l}: {n} experts' homes moved at plan {k}, the homes' layer time on the last {s} iterations "
                f"{now * 1e6:.1f} us -> {then * 1e6:.1f} us" if n else
                f"layer {l}: its move called off at plan {k}: the new homes do not fit beside the old in its memory"
                for k, l, n, now, then, s in self.moves]

    def cancel(self, layer: int, serving: np.ndarray) -> None:
        """The layer's move does not fit its memory: it keeps the homes that serve it ([E])."""
        self.homes[layer] = serving
        self._left[layer] = {(e, g) for e, g in self._left[layer] if serving[e] != g}
        self.moves.append((self.calls, layer, 0, 0.0, 0.0, 0))

    def released(self) -> np.ndarray:
        """[n, 3] (layer, expert, gpu) of the old homes the moves left that were last seen resident
        (Placement.release: evicted once the new home serves)."""
        rows = [(l, e, g) for l, left in enumerate(self._left) for e, g in sorted(left)]
        return np.array(rows, dtype=np.int64).reshape(-1, 3)

    def settle(self, layer: int, resident: LayerPlacement | None) -> tuple[LayerPlacement | None, np.ndarray]:
        """Step 4 for layer `layer`: (its resident replicas less the old homes a move left, once every
        new home of the layer is resident; the homes that serve it [E]: the new ones then, else the
        old homes of the experts that move). A layer half moved can be slower than either layout, so
        it switches at once, as production EPLB's does."""
        homes = self.homes[layer].copy()
        if resident is None or not self._left[layer]:
            return resident, homes
        pairs = set(zip(resident.expert.tolist(), resident.gpu.tolist()))
        self._left[layer] = left = {(e, g) for e, g in self._left[layer] if (e, g) in pairs}  # evicted: forgotten
        if not all((e, int(g)) in pairs for e, g in enumerate(homes)):  # not done yet: the old homes serve
            for e, g in left:
                homes[e] = g
            return resident, homes
        if not left:
            return resident, homes
        keep = np.array([(e, g) not in left for e, g in zip(resident.expert.tolist(), resident.gpu.tolist())])
        return LayerPlacement(resident.expert[keep], resident.gpu[keep], resident.share[keep]), homes

def add_moves(layer: LayerPlacement, homes: np.ndarray, serving: np.ndarray, free: np.ndarray,
              room: int) -> tuple[LayerPlacement, np.ndarray, bool]:
    """The layer plus, without tokens, the new home [E] of each expert that moves (its home is not
    the one serving [E]) where the layer lacks it: it loads while the old one serves. Only where it
    fits: a slot left on its GPU (free: [G]) and at most `room` more replicas in the layer (what its
    budget and the later layers leave). Returns (layer, free slots left [G], whether all fit); when
    not all fit, the layer unchanged (a half move never switches)."""
    missing = homes != serving
    missing[layer.expert[layer.gpu == homes[layer.expert]]] = False
    moving = np.flatnonzero(missing)
    need = np.bincount(homes[moving], minlength=free.shape[0])
    if not moving.size:
        return layer, free, True
    if moving.size > room or (need > free).any():
        return layer, free, False
    grown = LayerPlacement(np.concatenate([layer.expert, moving]), np.concatenate([layer.gpu, homes[moving]]),
                           np.concatenate([layer.share, np.zeros(moving.shape[0])]))
    return grown, free - need, True
