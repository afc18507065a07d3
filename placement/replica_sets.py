"""Replica sets chosen for dispatch room per GB: which experts of a layer get copies, and where.

Dispatch-time pairing (dispatch.py) gives each batch's tokens to the GPUs that hold their experts.
A copy is worth what it lowers the paired layer time over the batches it will serve, which the
batches' mean does not show: on a fine-grained MoE the mean loads are nearly even while each batch
has its own stragglers. So, per layer, with samples of the batches to come ([B, E]: the phase's
recent loads and the forecast):

1. Base: every expert's home and the resident copies that fit (resident_planner's `_base`: free
   to keep, warm inside keep-alive).
2. Candidates scored cheaply: each sample paired on the current set; a copy (e, g) is credited
   with the work it could take off the GPUs above the sample's level (the mean work, or the
   largest expert's, whichever is more): e's tokens there, at most their excess, at most g's room
   under the level less a call.
3. Greedy in steps: the LOOKAHEAD best-scored candidates are added in a row and each prefix timed
   exactly (the mean paired time over the samples); the prefix whose gain over the horizon beats
   its price by the most is kept (`ReplicaCost.cost`: the part of each load that prefetching
   cannot hide, and the GB·s it will hold, priced; the first copy also makes every call pay the
   data plane's pairing, `dispatch_s`). A prefix, since several GPUs can tie as the
   straggler and below the knee experts only move whole: one copy alone may gain nothing. Stop
   when no prefix pays, or at the budget or the slots.
4. The plan: homes with share 1, copies with share 0 (the data plane's pairing gives them tokens).

Golden example (alpha = 1 s/token, a call 1 s, beta 0, 2 GPUs, static EP's homes: experts 0, 1 on
GPU 0 and 2, 3 on GPU 1; samples [8, 1, 1, 1] and [1, 1, 8, 1]; a copy costs 1 s, horizon 1):
each sample's busy GPU works 8 + 1 + 1 + 1 = 11, the other 4. A copy of expert 0 on GPU 1 lets the
first sample split it 5 + 3 (8 and 8): the mean falls from 11 to 9.5, a gain of 1.5 for 1. With a
copy of expert 2 on GPU 0 as well both samples are at 8: a gain of 3 for 2, the better net, so
both are added (tests/placement/test_replica_sets.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeless.placement.dispatch import _pair
from moeless.placement.kernels import compiled
from moeless.placement.latency_model import LatencyModel
from moeless.placement.home_fits import static_homes
from moeless.placement.resident_planner import ReplicaCost, _base
from moeless.placement.shares import GAIN_EPSILON_S
from moeless.placement.types import LayerPlacement, PlacementError

LOOKAHEAD = 4  # best-scored candidates timed exactly per step before the set stops growing
CANDIDATE_EXPERTS = 4  # experts scored per GPU: the most loaded of those held there (x G in all)


@dataclass(frozen=True)
class SetDecision:
    """Mean paired layer seconds over the samples: base_s on the homes and resident copies, final_s
    with the copies added; added: (expert, gpu, gain_s over the horizon, cost_s) in order."""

    base_s: float
    final_s: float
    added: tuple[tuple[int, int, float, float], ...] = ()


def choose_replicas(samples: np.ndarray, free_slots: np.ndarray, resident: LayerPlacement | None, cost: ReplicaCost,
                    budget: int | None = None, dispatch_s: float = 0.0) -> tuple[LayerPlacement, np.ndarray, SetDecision]:
    """One layer's replica set (module docstring). samples: [B, E] token counts of the batches to
    come; free_slots: [G] replicas each GPU can still take; resident: the layer's warm replicas
    (None: static EP's); budget: most replicas (None: the slots); dispatch_s: what every call of a
    layer with copies pays the data plane (its pairing and the check whether it pays: the cost
    profile's relevel_s + check_s), counted in every set with a copy. Returns the placement (homes
    share 1, copies 0), the free slots left [G] and the decision."""
    samples = np.rint(np.atleast_2d(np.asarray(samples, dtype=np.float64))).astype(np.int64)
    free = np.asarray(free_slots, dtype=np.int64).reshape(-1)
    num_experts, num_gpus = samples.shape[1], free.shape[0]
    if samples.shape[0] == 0 or num_experts == 0 or (samples < 0).any():
        raise ValueError(f"samples must be a non-empty [B, E] array of token counts >= 0, got shape {samples.shape}")
    budget = int(free.sum()) if budget is None else min(budget, int(free.sum()))
    if budget < num_experts:
        raise PlacementError(f"a budget of {budget} replicas cannot hold {num_experts} experts; raise the layer memory cap")
    # 1. The base.
    expert, gpu, home = _base(samples.mean(axis=0), free, resident, budget, static_homes(num_experts, free.shape[0]))
    model = cost.model
    base_s = mean_paired_seconds(samples, expert, gpu, home.astype(np.float64), num_gpus, model)
    base_s += dispatch_s if expert.shape[0] > num_experts else 0.0
    now_s, added, held = base_s, [], np.bincount(gpu, minlength=num_gpus)
    loads = np.zeros(num_gpus, np.int64)
    resident_pairs = set() if resident is None else set(zip(resident.expert.tolist(), resident.gpu.tolist()))
    # 2.-3. Score, time the best few, add the first that pays.
    while expert.shape[0] < budget:
        score = _scores(samples, expert, gpu, home.astype(np.float64), num_gpus, model.alpha, model.call_overhead,
                        model.beta, CANDIDATE_EXPERTS)
        score[np.arange(num_experts)[:, None], np.arange(num_gpus)[None, :]] *= (held < free)[None, :]
        taken = np.zeros((num_experts, num_gpus), bool)
        taken[expert, gpu] = True
        score[taken] = 0.0
        order = [int(f) for f in np.argsort(-score, axis=None, kind="stable")[:LOOKAHEAD] if score.flat[f] > 0]
        best = None  # the prefix of the best-scored candidates that pays the most (several GPUs can tie)
        trial_e, trial_g, trial_h, price, trial_loads = expert, gpu, home, 0.0, loads.copy()
        for n, flat in enumerate(order):
            e, g = divmod(flat, num_gpus)
            if held[g] + np.count_nonzero(trial_g[expert.shape[0]:] == g) >= free[g] or expert.shape[0] + n >= budget:
                continue
            trial_e, trial_g, trial_h = np.append(trial_e, e), np.append(trial_g, g), np.append(trial_h, False)
            if (e, g) not in resident_pairs:
                price += cost.cost(int(trial_loads[g]), now_s)
                trial_loads[g] += 1
            trial_s = mean_paired_seconds(samples, trial_e, trial_g, trial_h.astype(np.float64), num_gpus, model) + dispatch_s
            net = (now_s - trial_s) * cost.horizon - price
            if net > GAIN_EPSILON_S and (best is None or net > best[0]):
                best = (net, trial_e, trial_g, trial_h, trial_s, trial_loads.copy(), (now_s - trial_s) * cost.horizon, price)
        if best is None:
            break
        _, trial_e, trial_g, trial_h, trial_s, loads, gain, price = best
        for e, g in zip(trial_e[expert.shape[0]:], trial_g[expert.shape[0]:]):
            added.append((int(e), int(g), float(gain), float(price)))
            held[g] += 1
        expert, gpu, home, now_s = trial_e, trial_g, trial_h, trial_s
    # 4. The plan.
    layer = LayerPlacement(expert, gpu, home.astype(np.float64))
    return layer, free - np.bincount(gpu, minlength=num_gpus), SetDecision(base_s, now_s, tuple(added))


def mean_paired_seconds(samples: np.ndarray, expert: np.ndarray, gpu: np.ndarray, share: np.ndarray, num_gpus: int,
                        model: LatencyModel) -> float:
    """The mean over samples [B, E] of the paired serial layer time of the replicas (expert, gpu)."""
    return _mean_paired(samples, expert.astype(np.int64), gpu.astype(np.int64), share, num_gpus, model.alpha,
                        model.call_overhead, model.beta)


@compiled
def _mean_paired(samples, expert, gpu, share, num_gpus, alpha, call, beta):
    total = 0.0
    for b in range(samples.shape[0]):
        total += _pair(samples[b], expert, gpu, share, num_gpus, alpha, call, beta)[1]
    return total / samples.shape[0]


@compiled
def _scores(samples, expert, gpu, share, num_gpus, alpha, call, beta, per_gpu):
    """Step 2: [E, G] credit of a copy of expert e on GPU g, summed over the samples. Only the
    per_gpu most loaded experts (over the samples) held on each GPU are scored."""
    num_experts = samples.shape[1]
    score = np.zeros((num_experts, num_gpus))
    mean = np.zeros(num_experts)
    for b in range(samples.shape[0]):
        for e in range(num_experts):
            mean[e] += samples[b, e]
    allowed = np.zeros(num_experts, np.bool_)
    for g in range(num_gpus):
        held = np.zeros(num_experts)
        for r in range(expert.shape[0]):
            if gpu[r] == g:
                held[expert[r]] = mean[expert[r]] + 1.0
        order = np.argsort(-held)
        for i in range(min(per_gpu, num_experts)):
            if held[order[i]] > 0:
                allowed[order[i]] = True
    for b in range(samples.shape[0]):
        tokens = samples[b]
        counts = _pair(tokens, expert, gpu, share, num_gpus, alpha, call, beta)[0]
        work = np.zeros(num_gpus)
        for r in range(expert.shape[0]):
            if counts[r] > 0:
                work[gpu[r]] += call + alpha * counts[r]
        level = work.sum() / num_gpus
        for e in range(num_experts):
            level = max(level, call + alpha * tokens[e] / num_gpus)
        for r in range(expert.shape[0]):
            e, src = expert[r], gpu[r]
            if not allowed[e] or counts[r] == 0 or work[src] <= level:
                continue
            movable = min(alpha * counts[r], work[src] - level)
            for g in range(num_gpus):
                room = level - work[g] - call
                if g != src and room > 0:
                    score[e, g] += min(movable, room)
    return score
