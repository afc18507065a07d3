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
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from moeless.placement.eplb import rebalance_experts
from moeless.placement.latency_model import LatencyModel
from moeless.placement.dispatch import pair_tokens
from moeless.placement.types import Placement


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
