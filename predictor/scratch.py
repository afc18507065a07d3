"""ProMoE-style baseline: a two-layer MLP per (l, d), larger than a gate, trained from scratch.

It sees the same examples, loss and validation-based stopping as the gate replicas
(predictor/finetune.py); only its starting point (random) and shape differ.
"""

from __future__ import annotations

import time
from dataclasses import replace

import torch
from torch import nn
from tqdm import tqdm

from moeless.predictor.dataset import RoutingTraces
from moeless.predictor.finetune import FitConfig, PairReport, fit_pair, pair_data
from moeless.predictor.gate_replica import ModulePredictor, Pair, topk_route

DEFAULT_WIDTH = 512


def scratch_mlp(hidden_size: int, num_experts: int, width: int = DEFAULT_WIDTH) -> nn.Sequential:
    """Linear(H, width) -> ReLU -> Linear(width, E), randomly initialised."""
    return nn.Sequential(nn.Linear(hidden_size, width), nn.ReLU(), nn.Linear(width, num_experts))


def train_scratch(
    model, fit: RoutingTraces, val: RoutingTraces, pairs: list[Pair], config: FitConfig = FitConfig(),
    width: int = DEFAULT_WIDTH, progress: bool = True,
) -> tuple[ModulePredictor, dict[Pair, PairReport]]:
    """An MLP per pair, trained for config.max_epochs (best validation epoch kept; no threshold)."""
    spec = model.spec
    route = topk_route(spec.top_k)
    budget = config.time_budget_s if config.time_budget_s is not None else float("inf")
    deadline = time.monotonic() + budget
    no_threshold = replace(config, threshold=float("inf"))
    modules, reports = {}, {}
    for pair in tqdm(pairs, desc="training MLP predictors", unit="layer", disable=not progress):
        torch.manual_seed(config.seed + 1000 * pair[0] + pair[1])
        modules[pair] = scratch_mlp(spec.hidden_size, spec.num_experts, width).eval()
        data = pair_data(model, fit, pair), pair_data(model, val, pair)
        reports[pair] = fit_pair(modules[pair], route, sum(pair), *data, no_threshold, deadline)
    return ModulePredictor("mlp", modules, route, spec.num_experts), reports
