"""Predicted MoE-layer time of a placement, under the paper's execution model and a serial one.

The paper (MoEless, section on the scaler) prices one replica at T = alpha * W / R and one GPU's
all-to-all at T_g = beta * (tokens on g); a layer takes max over replicas of T plus 2 * max_g T_g.
That lets replicas sharing a GPU run in parallel and split tokens fractionally. Real GPUs run
co-located replicas one after another on whole tokens, so `serial` prices a GPU at the sum of its
replicas' work (each call with tokens also pays a fixed call overhead). alpha, beta, the call
overhead and the cold start are measured (`moeless bench planner` does), never invented.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeless.placement.kernels import serial_time
from moeless.placement.types import LayerPlacement

EXECUTIONS = ("paper", "serial")


@dataclass(frozen=True)
class LatencyModel:
    """Measured costs, in seconds.

    alpha:         per token through one expert's FFN
    beta:          per token moved one way (one hidden vector serialised and copied)
    cold_start:    to load one expert's weights where it was not resident
    call_overhead: per replica call that has tokens (fixed cost of a small FFN call); serial only
    """

    alpha: float
    beta: float
    cold_start: float
    call_overhead: float = 0.0

    def __post_init__(self) -> None:
        for name in ("alpha", "beta", "cold_start", "call_overhead"):
            value = getattr(self, name)
            if not np.isfinite(value) or value < 0:
                raise ValueError(f"LatencyModel.{name} must be a finite non-negative number of seconds, got {value}")

    @property
    def call_tokens(self) -> float:
        """A call's fixed overhead in tokens of work (call_overhead / alpha; 0 when alpha is 0)."""
        return self.call_overhead / self.alpha if self.alpha > 0 else 0.0

    def layer_time(self, load: np.ndarray, layer: LayerPlacement, num_gpus: int, execution: str) -> float:
        """Seconds one MoE layer takes. load: [E] tokens per expert; both models add 2 beta max_g tokens_g.

        paper:  max over replicas of alpha * load[e] * share (replicas in parallel, fractional tokens);
        serial: max over GPUs of the sum of its replicas' alpha * tokens + call_overhead (whole
                tokens, largest-remainder split; compiled, as planners price candidates with it).
        """
        if execution == "serial":
            expert_tokens = np.asarray(load, dtype=np.int64)
            return serial_time(expert_tokens, layer.expert, layer.gpu, layer.share, num_gpus, self.alpha, self.call_overhead, self.beta)
        if execution == "paper":
            tokens = np.asarray(load)[layer.expert] * layer.share
            moved = np.bincount(layer.gpu, weights=tokens, minlength=num_gpus)
            return self.alpha * float(tokens.max(initial=0.0)) + 2.0 * self.beta * float(moved.max())
        raise ValueError(f"unknown execution model {execution!r}; use one of {EXECUTIONS}")
