"""Predictors that run a small module on the hidden states of layer l to get layer l+d's routing.

One class serves three methods, differing only in the modules: copies of the original gates
(plain gate reuse, as Mixtral-offloading does), fine-tuned gate replicas (moeless), and MLPs
trained from scratch (ProMoE-style, predictor/scratch.py). A module maps hidden [T, H] to
logits [T, E] of layer l+d; a routing rule turns the logits into top-k experts per token.
"""

from __future__ import annotations

import copy
from typing import Callable

import numpy as np
import torch
from torch import nn

from moeless.predictor.base import Forecast, load_from_topk
from moeless.predictor.dataset import RoutingTraces

Pair = tuple[int, int]  # (source layer l, distance d): the module predicts layer l + d from layer l
Route = Callable[[int, torch.Tensor], torch.Tensor]  # (target layer, logits [T, E]) -> idx [T, k]


class ModulePredictor:
    """A module per (source, distance) pair plus a routing rule."""

    def __init__(self, name: str, modules: dict[Pair, nn.Module], route: Route, num_experts: int):
        self.name = name
        self.modules = modules
        self.route = route
        self.num_experts = num_experts

    @torch.no_grad()
    def logits(self, source: int, distance: int, hidden: torch.Tensor) -> torch.Tensor:
        """hidden: [T, H] -> predicted logits of layer source + distance: [T, E]."""
        module = self.modules.get((source, distance))
        if module is None:
            raise KeyError(f"{self.name} has no predictor for layer {source} at distance {distance}; it has {sorted(self.modules)}")
        weight = next(module.parameters())
        return module(hidden.to(weight.dtype))

    @torch.no_grad()
    def predict(self, source: int, distance: int, hidden: torch.Tensor, trajectory: np.ndarray) -> Forecast:
        topk = self.route(source + distance, self.logits(source, distance, hidden)).cpu().numpy()
        return Forecast(load_from_topk(topk, self.num_experts), topk)

    def observe(self, loads: np.ndarray, trajectory: np.ndarray) -> None:
        """Stateless: predictions depend on the current hidden states only."""

    def to(self, device: str | torch.device) -> "ModulePredictor":
        """Move the modules to `device`, where the hidden states they read are (a GPU replica's)."""
        for module in self.modules.values():
            module.to(device)
        return self

    def nbytes(self) -> int:
        return sum(p.numel() * p.element_size() for m in self.modules.values() for p in m.parameters())


def gate_route(model) -> Route:
    """The model's own routing rule of the target layer (bias correction, groups and all)."""
    return lambda target, logits: model.routing_from_logits(target, logits).idx


def topk_route(top_k: int) -> Route:
    """The k largest logits: the rule for modules whose logits are not the gate's."""
    return lambda target, logits: torch.topk(logits, top_k, dim=-1).indices


def gate_copies(model, pairs: list[Pair]) -> dict[Pair, nn.Module]:
    """For each (l, d), an independent copy of gate l + d (same architecture, its weights)."""
    num_layers = model.spec.num_layers
    bad = [(l, d) for l, d in pairs if not (0 <= l and d >= 0 and l + d < num_layers)]
    if bad:
        raise ValueError(f"pairs {bad} need 0 <= l and 0 <= d with l + d < L = {num_layers}")
    return {(l, d): copy.deepcopy(model.gate(l + d)).requires_grad_(False) for l, d in pairs}


@torch.no_grad()
def rescaled_gate_copies(model, traces: RoutingTraces, pairs: list[Pair]) -> dict[Pair, nn.Module]:
    """Copies of gate l + d whose input channel c is scaled by rms_{l+d}[c] / rms_l[c] (over `traces`).

    Layer l's gate input differs from layer l+d's mostly per channel (each layer's norm has its
    own weights); a gate can carry huge weights on channels that are near zero in its own input
    and then mispredicts on layer l's. Folding the ratio into the weights keeps the architecture
    and size, and leaves d = 0 exactly the gate.
    """
    copies = gate_copies(model, pairs)
    rms = {l: traces.channel_rms(l) for l in sorted({l for pair in pairs for l in (pair[0], sum(pair))})}
    for (l, d), gate in copies.items():
        if d == 0:
            continue
        if not isinstance(gate, nn.Linear):
            raise TypeError(f"gate {l + d} is a {type(gate).__name__}; rescaling needs a bias-free nn.Linear [E, H]")
        scale = torch.where(rms[l] > 0, rms[l + d] / rms[l].clamp_min(1e-12), torch.ones_like(rms[l]))
        gate.weight.mul_(scale.to(gate.weight.dtype))
    return copies


def gate_reuse(model, pairs: list[Pair]) -> ModulePredictor:
    """Baseline: the original gate l + d applied to layer l's hidden states, untrained."""
    return ModulePredictor("gate_reuse", gate_copies(model, pairs), gate_route(model), model.spec.num_experts)


def all_pairs(num_layers: int, distances: list[int]) -> list[Pair]:
    """Every (l, d) with d in distances and l + d < L."""
    return [(l, d) for d in distances for l in range(num_layers) if l + d < num_layers]
