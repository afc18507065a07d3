"""Layer-aware fine-tuning of gate replicas, and the training loop it shares with the MLP baseline.

Accuracy here is the top-k hit rate (predictor/metrics.py) on validation prompts, which are held
out from the fit prompts by prompt (RoutingTraces.holdout). Training distils the target gate:
the loss is the cross-entropy between the module's softmax and the gate's own softmax on the
target layer's real input, so a replica learns the gate's whole ranking, not only its top-k.
"""

from __future__ import annotations

import copy
import time
from dataclasses import asdict, dataclass

import torch
from torch import nn
from tqdm import tqdm

from moeless.predictor.dataset import RoutingTraces
from moeless.predictor.gate_replica import ModulePredictor, Pair, Route, gate_route, rescaled_gate_copies
from moeless.predictor.metrics import topk_hit_rate


@dataclass(frozen=True)
class FitConfig:
    """How to train. threshold: fine-tune only pairs whose accuracy is below it, until they reach it.
    max_epochs: per pair; time_budget_s: for all pairs together (None: no limit)."""

    threshold: float = 0.8
    max_epochs: int = 20
    lr: float = 1e-3
    batch_size: int = 256
    time_budget_s: float | None = None
    seed: int = 0


@dataclass
class PairReport:
    """Validation accuracy of one (l, d) predictor before and after training."""

    before: float
    after: float
    epochs: int
    tuned: bool  # whether trained weights replaced the starting ones

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass(frozen=True)
class PairData:
    """One pair's examples. x: [N, H] inputs of layer l; soft: [N, E] the gate l+d's softmax; idx: [N, k]."""

    x: torch.Tensor
    soft: torch.Tensor
    idx: torch.Tensor


@torch.no_grad()
def pair_data(model, traces: RoutingTraces, pair: Pair) -> PairData:
    """The examples of pair (l, d) in `traces`, with the target gate's softmax as the soft label."""
    source, distance = pair
    x, x_target, idx = traces.pairs(source, distance)
    soft = torch.softmax(model.gate(source + distance)(x_target), dim=-1)
    return PairData(x, soft, idx)


@torch.no_grad()
def hit_rate(module: nn.Module, route: Route, target: int, data: PairData) -> float:
    """Top-k hit rate of module's routing against the actual experts of the examples."""
    return topk_hit_rate(route(target, module(data.x)).numpy(), data.idx.numpy())


def train_epoch(module: nn.Module, data: PairData, optimiser: torch.optim.Optimizer, batch_size: int, generator: torch.Generator) -> None:
    """One pass over the examples in random order, minimising the cross-entropy to the soft labels."""
    module.train()
    order = torch.randperm(data.x.shape[0], generator=generator)
    for start in range(0, len(order), batch_size):
        batch = order[start : start + batch_size]
        log_probs = torch.log_softmax(module(data.x[batch]), dim=-1)
        loss = -(data.soft[batch] * log_probs).sum(dim=-1).mean()
        optimiser.zero_grad()
        loss.backward()
        optimiser.step()
    module.eval()


def fit_pair(module: nn.Module, route: Route, target: int, fit: PairData, val: PairData, config: FitConfig, deadline: float) -> PairReport:
    """Train `module` in place, keeping the weights with the best validation accuracy.

    1. Score the starting weights on validation. 2. Train epoch by epoch; after each, score
    again and keep the best weights seen. 3. Stop at config.threshold, after max_epochs, or at
    the deadline (time.monotonic()). The module never ends worse on validation than it started.
    """
    before = best = hit_rate(module, route, target, val)
    best_state = copy.deepcopy(module.state_dict())
    module.requires_grad_(True)
    optimiser = torch.optim.Adam(module.parameters(), lr=config.lr)
    generator = torch.Generator().manual_seed(config.seed)
    epochs = 0
    while best < config.threshold and epochs < config.max_epochs and time.monotonic() < deadline:
        train_epoch(module, fit, optimiser, config.batch_size, generator)
        epochs += 1
        accuracy = hit_rate(module, route, target, val)
        if accuracy > best:
            best, best_state = accuracy, copy.deepcopy(module.state_dict())
    module.load_state_dict(best_state)
    module.requires_grad_(False)
    return PairReport(before=before, after=best, epochs=epochs, tuned=best > before)


def layer_aware_finetune(
    model, fit: RoutingTraces, val: RoutingTraces, pairs: list[Pair], config: FitConfig = FitConfig(), progress: bool = True
) -> tuple[ModulePredictor, dict[Pair, PairReport]]:
    """Gate replicas for `pairs`, fine-tuned only where the copied gate is under the threshold.

    1. Copy gate l+d for every pair, its input channels rescaled from layer l+d's statistics to
       layer l's (gate_replica.rescaled_gate_copies, on the fit traces), and profile its
       validation accuracy on layer l's inputs.
    2. Fine-tune the pairs under config.threshold, worst first (the time budget goes to them).
    3. Pairs already at the threshold, or out of budget, keep the gate's own weights.
    """
    route = gate_route(model)
    modules = rescaled_gate_copies(model, fit, pairs)
    profile = {pair: hit_rate(modules[pair], route, sum(pair), pair_data(model, val, pair)) for pair in pairs}
    reports = {pair: PairReport(before=acc, after=acc, epochs=0, tuned=False) for pair, acc in profile.items()}
    weak = sorted((p for p in pairs if profile[p] < config.threshold), key=profile.get)
    deadline = time.monotonic() + (config.time_budget_s if config.time_budget_s is not None else float("inf"))
    bar = tqdm(weak, desc="fine-tuning gate replicas", unit="layer", disable=not progress)
    for pair in bar:
        data = pair_data(model, fit, pair), pair_data(model, val, pair)
        reports[pair] = fit_pair(modules[pair], route, sum(pair), *data, config, deadline)
        bar.set_postfix(layer=pair[0], d=pair[1], acc=f"{reports[pair].before:.3f}->{reports[pair].after:.3f}")
    return ModulePredictor("gate_replica", modules, route, model.spec.num_experts), reports
