"""The Expert Placer: which GPU each replica of one layer goes on, and each replica's token share.

- `place_jsq_warm`: the paper's Algorithm 2. Replicas from most to least loaded; a replica whose
  expert was resident on a GPU in the previous placement stays there when that GPU has room
  (warm start), however loaded it is; otherwise join-shortest-queue (least-loaded GPU with room).
- `place_priced`: moeless's default. Experts from most to least loaded (LPT); GPU load is the
  sum of its replicas' tokens (they run one after another); a warm GPU is kept only while the
  straggler time it adds (latency model, times `horizon` iterations) costs less than the cold
  start it saves; an expert's tokens are split unevenly over its replicas to level their GPUs.
- `place_round_robin`: the "placer off" ablation: blocks as static EP, extra replicas round-robin.

All take free replica slots per GPU ([G] int, what earlier layers left) and return the
updated slots. Two replicas of one expert never share a GPU (they would gain nothing). An extra
replica is placed only while enough slots stay free for every expert's first replica.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import LayerPlacement, PlacementError

SPLITS = ("even", "level")


@dataclass(frozen=True)
class WarmMove:
    """A replica placed cold on `cold_gpu` although its expert was warm on `warm_gpu`, which had
    room: staying would have added `penalty_s` straggler seconds per iteration."""

    expert: int
    warm_gpu: int
    cold_gpu: int
    penalty_s: float


class _Slots:
    """Free slots per GPU, with the rule that first replicas always keep room."""

    def __init__(self, free_slots: np.ndarray, num_experts: int):
        self.free = [int(s) for s in free_slots]
        self.total = sum(self.free)
        self.unplaced = num_experts  # experts that still lack their first replica
        if self.total < num_experts:
            raise PlacementError(
                f"{self.total} free replica slots cannot hold {num_experts} experts; add GPU memory or GPUs"
            )

    def extra_allowed(self) -> bool:
        return self.total > self.unplaced

    def take(self, g: int, first: bool) -> None:
        self.free[g] -= 1
        self.total -= 1
        self.unplaced -= first

    def give_back(self, g: int) -> None:
        self.free[g] += 1
        self.total += 1


def _warm_map(previous: LayerPlacement | None, num_experts: int) -> list[list[int]]:
    """GPUs on which each expert was resident in the previous placement: E lists."""
    warm: list[list[int]] = [[] for _ in range(num_experts)]
    if previous is not None:
        for e, g in zip(previous.expert.tolist(), previous.gpu.tolist()):
            if e < num_experts:
                warm[e].append(g)
    return warm


def _least_loaded(gpu_load: list[float], slots: _Slots, taken: set[int], among: list[int] | range) -> int:
    """The least-loaded GPU of `among` with a free slot that does not hold the expert, or -1."""
    best, best_load = -1, float("inf")
    for g in among:
        if slots.free[g] > 0 and g not in taken and gpu_load[g] < best_load:
            best, best_load = g, gpu_load[g]
    return best


def _check(load: np.ndarray, logcnt: np.ndarray, free_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    load = np.asarray(load, dtype=np.float64)
    logcnt = np.asarray(logcnt, dtype=np.int64)
    if load.ndim != 1 or load.shape != logcnt.shape:
        raise ValueError(f"load and logcnt must both be [E]; got {load.shape} and {logcnt.shape}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("loads must be finite, non-negative token counts; check the forecast")
    if (logcnt < 1).any():
        raise ValueError("every expert needs at least one replica (logcnt >= 1)")
    if np.asarray(free_slots).size == 0:
        raise ValueError("placement needs at least one GPU; got zero GPUs")
    return load, logcnt


def place_jsq_warm(
    load: np.ndarray, logcnt: np.ndarray, free_slots: np.ndarray, previous: LayerPlacement | None = None
) -> tuple[LayerPlacement, np.ndarray]:
    """The paper's placer. load: [E] tokens, logcnt: [E] replicas, free_slots: [G].

    Returns the layer's placement (even shares) and the free slots left: [G].
    """
    load, logcnt = _check(load, logcnt, free_slots)
    num_experts, num_gpus = load.shape[0], len(free_slots)
    slots, warm = _Slots(free_slots, num_experts), _warm_map(previous, num_experts)
    gpu_load = [0.0] * num_gpus
    held: list[set[int]] = [set() for _ in range(num_experts)]
    # 1. Replicas from most to least loaded (ties: lower expert id first).
    per_replica = load / logcnt
    order = np.argsort(-per_replica, kind="stable")
    replicas = [(int(e), float(per_replica[e])) for e in order for _ in range(logcnt[e])]
    experts, gpus = [], []
    for e, x in replicas:
        first = not held[e]
        if not first and not slots.extra_allowed():
            continue
        # 2. Warm start on the least-loaded GPU where the expert was resident and room is left ...
        g = _least_loaded(gpu_load, slots, held[e], warm[e])
        # 3. ... else join the shortest queue.
        if g < 0:
            g = _least_loaded(gpu_load, slots, held[e], range(num_gpus))
        if g < 0:
            if first:
                raise PlacementError(f"no GPU has room for expert {e}'s first replica")
            continue
        slots.take(g, first)
        held[e].add(g)
        gpu_load[g] += x
        experts.append(e)
        gpus.append(g)
    layer = LayerPlacement.even(np.array(experts), np.array(gpus), num_experts)
    return layer, np.array(slots.free, dtype=np.int64)


def place_priced(
    load: np.ndarray,
    logcnt: np.ndarray,
    free_slots: np.ndarray,
    previous: LayerPlacement | None,
    model: LatencyModel,
    horizon: float = 1.0,
    split: str = "level",
) -> tuple[LayerPlacement, np.ndarray, list[WarmMove]]:
    """moeless's placer. load: [E] tokens, logcnt: [E] replicas, free_slots: [G].

    horizon: iterations a placement is expected to last (staying warm costs its penalty each
    iteration; a cold start is paid once). split: "level" (uneven shares that level the chosen
    GPUs) or "even". Returns the placement, the free slots left [G] and the warm replicas moved.
    """
    load, logcnt = _check(load, logcnt, free_slots)
    if split not in SPLITS:
        raise ValueError(f"unknown split {split!r}; use one of {SPLITS}")
    num_experts, num_gpus = load.shape[0], len(free_slots)
    slots, warm = _Slots(free_slots, num_experts), _warm_map(previous, num_experts)
    gpu_load = [0.0] * num_gpus
    balanced = float(load.sum()) / num_gpus
    all_gpus = range(num_gpus)
    experts, gpus, shares, moves = [], [], [], []
    # 1. Experts from most to least loaded (longest processing time first).
    for e in np.argsort(-load, kind="stable").tolist():
        w, want = float(load[e]), int(logcnt[e])
        x = w / want
        chosen: list[int] = []
        taken: set[int] = set()
        for r in range(want):
            if r and not slots.extra_allowed():
                break
            # 2. The best cold GPU (least loaded) against the best warm one, priced.
            g = _least_loaded(gpu_load, slots, taken, all_gpus)
            if g < 0:
                break
            if g not in warm[e]:
                hot = _least_loaded(gpu_load, slots, taken, warm[e])
                if hot >= 0:
                    straggler = max(balanced, max(gpu_load), gpu_load[g] + x)
                    penalty = model.alpha * max(0.0, gpu_load[hot] + x - straggler)
                    if penalty * horizon <= model.cold_start:
                        g = hot
                    else:
                        moves.append(WarmMove(e, hot, g, penalty))
            slots.take(g, not chosen)
            chosen.append(g)
            taken.add(g)
        if not chosen:
            raise PlacementError(f"no GPU has room for expert {e}'s first replica")
        # 3. Split the expert's tokens; a replica left with no tokens gives its slot back.
        part = _level_shares(w, [gpu_load[g] for g in chosen]) if split == "level" else [1.0 / len(chosen)] * len(chosen)
        for g, s in zip(chosen, part):
            if s <= 0.0 and len(chosen) > 1:
                slots.give_back(g)
                continue
            gpu_load[g] += w * s
            experts.append(e)
            gpus.append(g)
            shares.append(s)
    layer = LayerPlacement(np.array(experts, dtype=np.int64), np.array(gpus, dtype=np.int64), _normalise(experts, shares, num_experts))
    return layer, np.array(slots.free, dtype=np.int64), moves


def _level_shares(tokens: float, loads: list[float]) -> list[float]:
    """Shares of `tokens` that fill the lowest of `loads` up to one common level (water-filling).

    loads: [R] current GPU loads -> [R] shares summing to 1 (zero where a GPU is above the level).
    """
    if tokens <= 0:
        return [1.0 / len(loads)] * len(loads)
    ordered = sorted(loads)
    level, water = ordered[0] + tokens, ordered[0] + tokens  # water: tokens plus the loads under the level
    for i in range(1, len(ordered)):
        if ordered[i] >= level:
            break
        water += ordered[i]
        level = water / (i + 1)
    return [max(0.0, level - l) / tokens for l in loads]


def _normalise(experts: list[int], shares: list[float], num_experts: int) -> np.ndarray:
    """Shares rescaled to sum to exactly 1 per expert (dropping empty replicas changes the sum)."""
    expert = np.array(experts, dtype=np.int64)
    share = np.array(shares, dtype=np.float64)
    return share / np.bincount(expert, weights=share, minlength=num_experts)[expert]


def place_round_robin(load: np.ndarray, logcnt: np.ndarray, free_slots: np.ndarray) -> tuple[LayerPlacement, np.ndarray]:
    """The "placer off" ablation: expert e's first replica on GPU e*G//E (static EP's blocks), its
    extra replicas on the following GPUs in turn; loads are ignored. Returns placement and slots."""
    load, logcnt = _check(load, logcnt, free_slots)
    num_experts, num_gpus = load.shape[0], len(free_slots)
    slots = _Slots(free_slots, num_experts)
    experts, gpus = [], []
    for e in range(num_experts):
        home = e * num_gpus // num_experts
        placed = 0
        for step in range(num_gpus):
            if placed == logcnt[e] or (placed and not slots.extra_allowed()):
                break
            g = (home + step) % num_gpus
            if slots.free[g] > 0:
                slots.take(g, not placed)
                experts.append(e)
                gpus.append(g)
                placed += 1
        if not placed:
            raise PlacementError(f"no GPU has room for expert {e}'s first replica")
    layer = LayerPlacement.even(np.array(experts), np.array(gpus), num_experts)
    return layer, np.array(slots.free, dtype=np.int64)
