"""The Oracle balancer: a lossy lower bound, never a product.

It ignores the gate and gives every expert the same number of tokens (whole tokens, the
remainder one each to the lowest expert ids), on static EP's placement. No real planner may
do this (outputs would change), so it only bounds how balanced a layer could be.
"""

from __future__ import annotations

import numpy as np


def oracle_load(load: np.ndarray) -> np.ndarray:
    """The same total spread evenly over experts. load: [..., E] -> [..., E] int."""
    load = np.asarray(load)
    if (load < 0).any():
        raise ValueError("loads must be non-negative token counts")
    num_experts = load.shape[-1]
    total = np.rint(load.sum(axis=-1, keepdims=True)).astype(np.int64)
    base, extra = total // num_experts, total % num_experts
    return base + (np.arange(num_experts) < extra)
