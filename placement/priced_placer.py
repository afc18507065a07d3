"""moeless-greedy's Expert Placer (an earlier generation of moeless, kept as a named baseline): replicas of one layer on GPUs, pricing every cold start.

A GPU's work is the sum of its replicas' work (they run one after another). Single-replica
experts go first, most to least loaded (LPT); then replicated experts split their tokens
unevenly to level the least-loaded GPUs; then, within the layer's replica budget, extra replicas
relieve the busiest GPU. Every cold start is priced with the latency model: a warm GPU is left
only when the straggler time staying adds, times `horizon` iterations, exceeds the cold start,
and a cold extra replica must save more than that. Slots and the no-two-replicas-per-GPU rule
are those of placement/placer.py.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeless.placement.latency_model import LatencyModel
from moeless.placement.placer import _check, _Gpus, _warm_map
from moeless.placement.types import LayerPlacement, PlacementError

# Step 5 stops within one token or 1% of the balanced work (closer gains too little for its replicas)
# and tries the 3 heaviest replicas on the busiest GPU (enough in practice, and it bounds the time).
RELIEF_TOKENS, RELIEF_FRACTION, RELIEF_TRIES = 1.0, 0.01, 3


@dataclass(frozen=True)
class WarmMove:
    """A replica placed cold on `cold_gpu` although its expert was warm on `warm_gpu`, which had
    room: staying would have added `penalty_s` straggler seconds per iteration."""

    expert: int
    warm_gpu: int
    cold_gpu: int
    penalty_s: float

def place_priced(
    load: np.ndarray,
    logcnt: np.ndarray,
    free_slots: np.ndarray,
    previous: LayerPlacement | None,
    model: LatencyModel,
    horizon: float = 1.0,
    budget: int | None = None,
    gpu_load: np.ndarray | None = None,
) -> tuple[LayerPlacement, np.ndarray, list[WarmMove]]:
    """moeless-greedy's placer. load: [E] tokens, logcnt: [E] replicas, free_slots: [G].

    A GPU's work is counted in tokens plus, per replica call with tokens, the model's call
    overhead in tokens (call_overhead / alpha). horizon: iterations over which a cold start is
    amortised (staying warm costs its penalty each iteration; a cold start is paid once). An
    expert's replicas split its tokens unevenly, to level the GPUs they land on. budget: most
    replicas the layer may hold; replicas beyond logcnt (up to it) relieve the busiest GPU while
    that pays (step 5). gpu_load: [G] work the GPUs already carry (default none). Returns the
    placement, the free slots left [G] and the warm replicas that moved.
    """
    load, logcnt = _check(load, logcnt, free_slots)
    num_experts, num_gpus = load.shape[0], len(free_slots)
    gpus, warm = _Gpus(free_slots, num_experts, gpu_load), _warm_map(previous, num_experts)
    alpha = model.alpha
    call = model.call_tokens
    peak = max(gpus.work)  # the most work on any GPU so far
    balanced = (float(load.sum()) + call * np.count_nonzero(load) + sum(gpus.work)) / num_gpus
    loads, counts = load.tolist(), logcnt.tolist()
    experts, placed, shares, moves = [], [], [], []
    cold_start = model.cold_start

    def pick(e: int, item: float) -> int:
        """2. The best cold GPU (least loaded) against the best warm one, priced in seconds; -1 if none."""
        g, warm_e = gpus.least(gpus.all), warm[e]
        if g >= 0 and warm_e and g not in warm_e:
            hot = gpus.least(warm_e)
            if hot >= 0:
                straggler = max(balanced, peak, gpus.work[g] + item)
                penalty = alpha * max(0.0, gpus.work[hot] + item - straggler)
                if penalty <= 0.0 or penalty * horizon <= cold_start:
                    return hot
                moves.append(WarmMove(e, hot, g, penalty))
        return g

    # 1. Single-replica experts from most to least loaded (longest processing time first), then
    #    replicated ones, whose tokens split, to level the least-loaded GPUs.
    for e in np.lexsort((-load, logcnt > 1)).tolist():
        w, want = loads[e], counts[e]
        item = w / want + (call if w > 0 else 0.0)
        if want == 1:  # the common case: one GPU, nothing to split
            g = pick(e, item)
            if g < 0:
                raise PlacementError(f"no GPU has room for expert {e}'s first replica")
            gpus.take_alone(g, item)
            peak = max(peak, gpus.work[g])
            experts.append(e)
            placed.append(g)
            shares.append(1.0)
            continue
        chosen: list[int] = []
        for _ in range(1 + min(want - 1, gpus.spare())):
            g = pick(e, item)
            if g < 0:
                break
            # 3. A cold extra replica must save more than its cold start: each replica's tokens shrink.
            if chosen and g not in warm[e]:
                saved = alpha * (w / len(chosen) - w / (len(chosen) + 1))
                if saved * horizon <= cold_start:
                    break
            gpus.hold(g)
            chosen.append(g)
        if not chosen:
            raise PlacementError(f"no GPU has room for expert {e}'s first replica")
        # 4. Split the expert's tokens; a GPU left with no tokens gets no replica.
        if len(chosen) == 1:
            part = [1.0]
        elif w > 0:
            part = _at_least_a_token(w, _level_shares(w, [gpus.work[g] + call for g in chosen]))
            for hot, cold, extra in _warm_left_idle(e, chosen, part, warm[e], gpus.work, w, call, max(balanced, peak)):
                if alpha * extra * horizon > cold_start:
                    moves.append(WarmMove(e, hot, cold, alpha * extra))
                else:  # staying warm is cheaper: the warm GPU takes the cold one's tokens
                    i, j = chosen.index(hot), chosen.index(cold)
                    part[i], part[j] = part[j], 0.0
        else:
            part = [1.0 / len(chosen)] * len(chosen)
        first = True
        for g, s in zip(chosen, part):
            if s <= 0.0:
                continue
            gpus.take(g, first, w * s + (call if w > 0 else 0.0))
            first = False
            peak = max(peak, gpus.work[g])
            experts.append(e)
            placed.append(g)
            shares.append(s)
        gpus.release(chosen)
    if budget is not None:
        spare = min(budget - len(experts), gpus.spare())
        _relieve_busiest(gpus, experts, placed, shares, loads, warm, spare, balanced, call, model, horizon)
    _return_home(gpus, experts, placed, shares, loads, warm, call, model, horizon, moves)
    expert = np.array(experts, dtype=np.int64)
    layer = LayerPlacement(expert, np.array(placed, dtype=np.int64), _normalise(expert, shares, num_experts))
    return layer, np.array(gpus.free, dtype=np.int64), moves


def _relieve_busiest(
    gpus: _Gpus, experts: list[int], placed: list[int], shares: list[float], loads: list[float],
    warm: list[list[int]], spare: int, balanced: float, call: float, model: LatencyModel, horizon: float,
) -> None:
    """5. While the busiest GPU is above the balanced work and spare replicas remain: give an
    expert there (most tokens first) one more replica, on a GPU where it is warm, else on the
    least-loaded GPU, and re-level its tokens over its GPUs; a change is kept only if the busiest
    GPU's work drops, by more than a cold start costs (per horizon) when the new replica is cold.
    Edits the replica lists (experts, placed, shares: [R]) and gpus in place."""
    # Replica indices per expert and per GPU, ascending, so no try scans every replica. A dropped
    # replica gets GPU -1 and leaves the lists at the end, so indices stay valid meanwhile.
    by_expert: list[list[int]] = [[] for _ in loads]
    by_gpu: list[list[int]] = [[] for _ in gpus.free]
    for i, (e, g) in enumerate(zip(experts, placed)):
        by_expert[e].append(i)
        by_gpu[g].append(i)
    for _ in range(max(spare, 0)):
        top = gpus.work.index(max(gpus.work))  # the first busiest GPU
        if gpus.work[top] - balanced <= max(RELIEF_TOKENS, RELIEF_FRACTION * balanced):
            break
        tries = sorted(by_gpu[top], key=lambda i: -loads[experts[i]] * shares[i])[:RELIEF_TRIES]
        if not any(_add_replica(gpus, experts, placed, shares, loads, warm, by_expert, by_gpu, experts[i], top, call, model, horizon)
                   for i in tries):
            break
    if -1 in placed:
        kept = [i for i, g in enumerate(placed) if g >= 0]
        experts[:], placed[:], shares[:] = [experts[i] for i in kept], [placed[i] for i in kept], [shares[i] for i in kept]


def _add_replica(
    gpus: _Gpus, experts: list[int], placed: list[int], shares: list[float], loads: list[float], warm: list[list[int]],
    by_expert: list[list[int]], by_gpu: list[list[int]], e: int, top: int, call: float, model: LatencyModel, horizon: float,
) -> bool:
    """One more replica of expert e if it lowers GPU `top`'s work and pays for itself; True if added.
    by_expert [E], by_gpu [G]: replica indices of each expert and on each GPU, kept up to date."""
    mine = by_expert[e]
    held = {placed[i] for i in mine}
    hot = [g for g in warm[e] if g not in held and gpus.free[g] > 0]
    target = gpus.least(hot) if hot else -1
    if target < 0:
        target = min((g for g in gpus.all if g not in held and gpus.free[g] > 0), key=gpus.work.__getitem__, default=-1)
    if target < 0:
        return False
    w = loads[e]
    slots = [placed[i] for i in mine] + [target]
    base = [gpus.work[placed[i]] - w * shares[i] - call for i in mine] + [gpus.work[target]]  # work without e
    part = _at_least_a_token(w, _level_shares(w, [b + call for b in base]))
    after = [b + (w * p + call if p > 0 else 0.0) for b, p in zip(base, part)]
    gain = gpus.work[top] - max(after)
    if gain <= 1e-9 or (target not in warm[e] and model.alpha * gain * horizon <= model.cold_start):
        return False
    for g, a in zip(slots, after):
        gpus.work[g] = a
    for i, p in zip(mine, part):
        shares[i] = p
    gpus.take(target, False, 0.0)
    for i in mine:
        if shares[i] <= 0:  # a replica left without tokens goes
            gpus.free[placed[i]] += 1
            gpus.total += 1
            by_gpu[placed[i]].remove(i)
            placed[i] = -1
    by_expert[e] = [i for i in mine if placed[i] >= 0] + [len(experts)]
    by_gpu[target].append(len(experts))
    experts.append(e)
    placed.append(target)
    shares.append(part[-1])
    return True


def _return_home(
    gpus: _Gpus, experts: list[int], placed: list[int], shares: list[float], loads: list[float],
    warm: list[list[int]], call: float, model: LatencyModel, horizon: float, moves: list[WarmMove],
) -> None:
    """6. Greedy order can fill a warm GPU before its expert's turn and free room there later
    (replicas dropped in steps 4-5). A replica that went cold while a warm GPU of its expert has
    room now goes back there, unless that raises the busiest GPU's work by more than the cold
    start it saves: then it stays, recorded as a priced move. Edits the lists and gpus in place."""
    # Only replicas off every warm GPU of their expert can go home; each is settled once priced.
    pending = [i for i, (e, g) in enumerate(zip(experts, placed)) if warm[e] and g not in warm[e]]
    if not pending:
        return
    held: dict[int, set[int]] = {experts[i]: set() for i in pending}  # GPUs holding each such expert
    for e, g in zip(experts, placed):
        if e in held:
            held[e].add(g)
    priced = {(m.expert, m.cold_gpu) for m in moves}  # moves already recorded (step 2 or here)
    work, free, alpha, cold_start = gpus.work, gpus.free, model.alpha, model.cold_start
    changed = True
    while changed:
        changed, waiting, busiest = False, [], max(work)
        for i in pending:
            e, g = experts[i], placed[i]
            homes = [h for h in warm[e] if h not in held[e] and free[h] > 0]
            if not homes:
                waiting.append(i)  # a home may free up later in this pass
                continue
            h = min(homes, key=work.__getitem__)
            item = loads[e] * shares[i] + (call if loads[e] * shares[i] > 0 else 0.0)
            extra = max(0.0, work[h] + item - busiest)
            if alpha * extra * horizon > cold_start:
                if (e, g) not in priced:
                    priced.add((e, g))
                    moves.append(WarmMove(e, h, g, alpha * extra))
                continue
            work[g] -= item
            work[h] += item
            free[g] += 1
            free[h] -= 1
            held[e].discard(g)
            held[e].add(h)
            placed[i] = h
            changed, busiest = True, max(work)
        pending = waiting


def _warm_left_idle(
    e: int, chosen: list[int], part: list[float], warm: list[int], work: list[float], w: float, call: float, straggler: float
) -> list[tuple[int, int, float]]:
    """4b. Pairs (warm GPU, cold GPU, penalty in tokens) where a level split left a warm GPU of
    expert e without tokens while a cold one got them: a move, to be priced like one. The penalty
    is the work the warm GPU would add above the straggler if it took the cold one's tokens."""
    idle = [g for g, p in zip(chosen, part) if g in warm and p <= 0.0]
    busy = [(g, p) for g, p in zip(chosen, part) if g not in warm and p > 0.0]
    return [(hot, cold, max(0.0, work[hot] + w * p + call - max(straggler, work[cold] + w * p + call)))
            for hot, (cold, p) in zip(idle, busy)]


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


def _at_least_a_token(tokens: float, shares: list[float]) -> list[float]:
    """Shares worth less than one token become 0 (a call for a fraction of a token only costs);
    the rest are rescaled to sum to 1. The largest share always stays."""
    kept = [s if tokens * s >= 1.0 or s == max(shares) else 0.0 for s in shares]
    total = sum(kept)
    return [s / total for s in kept]


def _normalise(expert: np.ndarray, shares: list[float], num_experts: int) -> np.ndarray:
    """Shares rescaled to sum to exactly 1 per expert (dropping empty replicas changes the sum).

    expert: [R] int, shares: [R] -> [R] float."""
    share = np.array(shares, dtype=np.float64)
    return share / np.bincount(expert, weights=share, minlength=num_experts)[expert]
