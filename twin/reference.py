"""An offline reference between static EP and the lossless bound: what EPLB reaches when it knows
each iteration's loads exactly and moves experts for free.

The lossless bound (twin/bound.py) spreads work as if a GPU could take a fraction of a call; no
plan of whole replicas may reach it. This reference says how far a strong, known planner gets
with every advantage nothing online has, so a gap between moeless and the bound can be split into
"no plan we know gets there" and "moeless leaves it". It is neither a bound (EPLB is a heuristic)
nor a claim (the loads are the iteration's own; moves cost nothing, no cold start, no memory).

Per iteration, with loads W [L, E] on G GPUs:
1. EPLB (placement/eplb.py) on W itself, at each budget of replicas per layer (a multiple of G;
   E alone re-pairs experts across GPUs without replicating any).
2. Each layer's tokens paired with its replicas on W as moeless's data plane does (`pair_tokens`: whole
   tokens, a replica may get none, so an extra replica that does not pay its call is left idle).
3. Per layer, the fastest of those plans and static EP.

Tiny example (a call costs one token's time, G = 2, E = 4, budget 4): W = [10, 6, 1, 1]. Static EP
puts experts 0, 1 on GPU 0 (10 + 1 + 6 + 1 = 18) and 2, 3 on GPU 1 (4): 18. EPLB pairs 0 with 3
and 1 with 2 (11 + 2 = 13 and 7 + 2 = 9): 13 of static EP's 18.

`hindsight_homes` is the other side of that split: what a fixed pairing of experts with GPUs (no
copy) reaches when it is fitted on the run's own loads but not on the batches it is scored on.
The run's iterations fall in two folds of alternating blocks of HINDSIGHT_BLOCK; each fold is
scored on homes fitted on the other (placement/home_moves.py's step 2: EPLB's packing of the
fold's summed loads, then its swaps on up to HINDSIGHT_SAMPLES of the fold's iterations), every
token at its home, moved for free. Fitted on the scored batches themselves, the swaps would fit
their noise (on FLAME's 8 x A6000 cell, up to 64 swaps fitted and timed on the same batches read
67% / 45% of the bound's gain in prefill / decode, where these cross-fitted homes read 55% / 30%). Below moeless, the gain moeless reaches is more than
knowing the workload gives a fixed layout; above it, moeless's homes (chosen online, on the past)
leave that much; what it leaves of the bound is each batch's own imbalance, which only a
per-batch choice (copies paired at dispatch, or the offline reference's free moves) reaches. A
heuristic, not a bound. Tiny example (the same costs, G = 2, E = 4, blocks of 1): iterations
[[10, 10, 0, 0], [0, 0, 10, 10], [10, 10, 0, 0], [0, 0, 10, 10]]: static EP's blocks make 22 in
each (one GPU holds both busy experts); either fold's homes put the two busy experts of every
iteration on different GPUs: 11 in each.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moeless.placement.eplb import rebalance_experts
from moeless.placement.home_fits import home_seconds, packed_homes, swapped_homes
from moeless.placement.latency_model import LatencyModel
from moeless.placement.dispatch import pair_tokens
from moeless.placement.types import Placement

HINDSIGHT_BLOCK = 25  # iterations a fold's block holds (consecutive decode batches share their requests)
HINDSIGHT_SAMPLES = 128  # a fold's iterations its swaps weigh, evenly spaced (all where fewer; the time grows with them)


def offline_reference(loads: np.ndarray, num_gpus: int, model: LatencyModel, budgets: Sequence[int]) -> np.ndarray:
    """Seconds per layer (serial execution): loads [I, L, E] whole tokens per expert -> [I, L].
    budgets: replicas per layer EPLB may use, each a multiple of num_gpus and at least E."""
    loads = np.asarray(loads, dtype=np.int64)
    num_iter, num_layers, num_experts = loads.shape
    for b in budgets:
        if b % num_gpus or b < num_experts:
            raise ValueError(f"a budget is a multiple of the {num_gpus} GPUs and at least the {num_experts} experts, got {b}")
    static = Placement.static(num_layers, num_experts, num_gpus)
    out = np.empty((num_iter, num_layers))
    for i, w in enumerate(loads):
        plans = [static] + [Placement.from_eplb(rebalance_experts(w, b, 1, 1, num_gpus)[0], num_experts, num_gpus)
                            for b in budgets]  # 1.
        for l in range(num_layers):
            out[i, l] = min(model.layer_time(w[l], pair_tokens(w[l], p.layers[l], model, num_gpus), num_gpus, "serial")
                            for p in plans)  # 2., 3.
    return out


def hindsight_homes(loads: np.ndarray, num_gpus: int, model: LatencyModel) -> np.ndarray:
    """Seconds per layer (serial execution, every token at its home): loads [I, L, E] -> [I, L],
    each iteration on the homes [L, E] fitted on the other fold's iterations (module docstring).
    A run of one block has one fold: it is scored on homes fitted on itself."""
    loads = np.rint(np.asarray(loads, dtype=np.float64))
    fold = (np.arange(loads.shape[0]) // HINDSIGHT_BLOCK) % 2
    out = np.empty(loads.shape[:2])
    for scored in np.unique(fold):
        fitted = loads[fold != scored] if (fold != scored).any() else loads
        packed = packed_homes(fitted.sum(axis=0), num_gpus)
        weighed = np.unique(np.linspace(0, fitted.shape[0] - 1, min(fitted.shape[0], HINDSIGHT_SAMPLES)).astype(np.int64))
        for l in range(loads.shape[1]):
            homes = swapped_homes(fitted[weighed, l], packed[l], num_gpus, model)
            out[fold == scored, l] = home_seconds(loads[fold == scored, l], homes, num_gpus, model)
    return out
