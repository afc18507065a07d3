"""Expert-Specialized Fine-Tuning (ESFT, Wang et al. 2024, arXiv 2407.01906; DeepSeek's method).

ESFT tunes only the experts a task routes to most and freezes everything else (router, attention,
shared experts, embeddings, every other expert), so a fine-tune is its base plus a few replaced
experts: what moeless' expert functions can serve from one pool with the base's own.

1. Score every (layer, expert) on the task's training tokens through the base's own routing, as
   DeepSeek's ESFT repository's expert-scoring script does (pooled over all tokens):
   - "token" (ESFT-Token, token-selection ratio): the share of the layer's k choices per token
     that go to the expert, count / (T k); a layer's scores sum to 1;
   - "gate" (ESFT-Gate, average gate score): the expert's gate value summed over the tokens that
     chose it, / T. The gate value is the softmax of the router logits over all experts at the
     chosen expert (DeepSeek-V2's s_{i,t}, not renormalised over the top k): the default model
     adds every chosen expert with weight 1.0, so its combine weights cannot rank experts.
2. Select per layer the best-scored experts: exactly floor(share E) of them, or ESFT's rule with a
   threshold p (add experts by score until their cumulative score reaches p), capped at
   floor(share E) so the share of replaced experts always holds.
3. Train the selected experts' gate/up/down only, on next-token loss (train_experts).

Default "token": in the default model each chosen expert's output enters the residual stream with
weight 1.0, so the token ratio is exactly each expert's share of the task's expert outputs and of
the gradient a full fine-tune would give the experts; the gate score ranks by the ridge router's
confidence, which only orders experts. DeepSeek's own README example also selects with "token".
"""

from __future__ import annotations

import copy
import math
import time
from dataclasses import dataclass

import torch
from torch.func import functional_call
from tqdm import tqdm

from moeless.model.moe_model import MoEModel
from moeless.model.sliced_moe import SlicedMoE

SCORES = ("token", "gate")
EXPERT_PARAMS = ("gate_proj", "up_proj", "down_proj")  # SlicedMoE's stacked experts: [E, F, H], [E, F, H], [E, H, F]


@torch.no_grad()
def expert_scores(model: "MoEModel", blocks: torch.Tensor, score: str = "token", batch_size: int = 8) -> torch.Tensor:
    """ESFT's relevance of every expert to the task whose tokens are `blocks` ([N, S] ids, no padding).

    -> [L, E] float64: "token" (selection ratio, rows sum to 1) or "gate" (average gate score).
    """
    if score not in SCORES:
        raise ValueError(f"score must be one of {SCORES}, got {score!r}")
    spec = model.spec
    total = torch.zeros(spec.num_layers, spec.num_experts, dtype=torch.float64)
    tokens = 0
    with model.capture() as capture:
        for start in range(0, len(blocks), batch_size):
            model.forward(blocks[start:start + batch_size])
    for iteration in capture.iterations:
        tokens += iteration[0].idx.shape[0]
        for layer, record in enumerate(iteration):
            if score == "token":
                total[layer] += torch.bincount(record.idx.reshape(-1), minlength=spec.num_experts).double() / spec.top_k
            else:
                probs = torch.softmax(model.gate(layer)(record.gate_input).double(), dim=-1)
                total[layer].index_add_(0, record.idx.reshape(-1), probs.gather(1, record.idx).reshape(-1))
    return total / max(tokens, 1)


def select_experts(scores: torch.Tensor, share: float, threshold: float | None = None) -> list[list[int]]:
    """Per layer, the experts to tune: the best-scored floor(share E), or with threshold p the fewest
    whose cumulative score reaches p (ESFT's rule), capped at floor(share E). Ties go to the lower
    index. scores: [L, E] -> sorted expert lists, one per layer.

    >>> s = torch.tensor([[0.10, 0.40, 0.30, 0.20], [0.25, 0.25, 0.05, 0.45]])
    >>> select_experts(s, 0.5)
    [[1, 2], [0, 3]]
    >>> select_experts(s, 0.5, threshold=0.4)
    [[1], [3]]
    >>> select_experts(s, 0.25, threshold=0.9)
    [[1], [3]]
    """
    num_experts = scores.shape[1]
    cap = math.floor(share * num_experts + 1e-9)
    if not 0 < share <= 1 or cap < 1:
        raise ValueError(f"share must be in (0, 1] and select at least one of {num_experts} experts per layer "
                         f"(floor(share x {num_experts}) >= 1), got {share}")
    chosen = []
    for row in scores.tolist():
        order = sorted(range(num_experts), key=lambda e: (-row[e], e))
        if threshold is None:
            picked = order[:cap]
        else:
            picked, cumulative = [], 0.0
            for e in order:
                if cumulative >= threshold:
                    break
                picked.append(e)
                cumulative += row[e]
        chosen.append(sorted(picked[:cap]))
    return chosen


@dataclass(frozen=True)
class TrainConfig:
    """How the selected experts are trained: AdamW (no weight decay, so an expert's update is the
    loss's alone) on next-token loss over packed blocks, `batch` blocks per step, rows cycled in a
    seeded order; gradient norm clipped at 1.0."""

    steps: int = 24
    batch: int = 4
    lr: float = 1e-3
    seed: int = 0


def loss_summary(losses: list[float]) -> dict[str, float]:
    """Mean training loss over the first and the last quarter of the steps (one batch's loss is
    too noisy to compare: its blocks differ from the next batch's)."""
    quarter = max(1, len(losses) // 4)
    return {"loss_start": round(sum(losses[:quarter]) / quarter, 4), "loss_end": round(sum(losses[-quarter:]) / quarter, 4)}


def batches(blocks: torch.Tensor, cfg: TrainConfig):
    """The training batches: `cfg.steps` of `cfg.batch` rows of blocks [N, S], a seeded permutation
    cycled (deterministic for cfg.seed)."""
    order = torch.randperm(len(blocks), generator=torch.Generator().manual_seed(cfg.seed))
    for step in range(cfg.steps):
        rows = [order[(step * cfg.batch + i) % len(order)] for i in range(cfg.batch)]
        yield blocks[torch.stack(rows)]


def train_experts(model: "MoEModel", selected: list[list[int]], blocks: torch.Tensor, cfg: TrainConfig = TrainConfig(),
                  progress: bool = False) -> tuple["MoEModel", dict]:
    """ESFT: a copy of model whose selected experts (selected[l]: layer l's expert ids) are trained
    on next-token loss over blocks ([N, S] token ids, no padding); every other tensor stays the
    base's, bit for bit. -> (the tuned MoEModel, {"steps", "tokens", "seconds", "cpu_seconds", "loss_start", "loss_end"}).

    Only the selected experts' rows are parameters: each step rebuilds a layer's stacked expert
    tensors from the frozen base and those rows (functional_call), so the optimizer never sees a
    frozen weight. Needs the moeless-sliced arch (the default model).
    """
    hf = copy.deepcopy(model.hf)
    hf.requires_grad_(False)
    decoder = hf.model.layers
    trainable: dict[str, tuple[torch.Tensor, torch.Tensor, torch.nn.Parameter]] = {}
    for layer, experts in enumerate(selected):
        if not experts:
            continue
        block = decoder[model.spec.moe_layer_ids[layer]].mlp
        if not isinstance(block, SlicedMoE):
            raise ValueError(f"ESFT training needs the moeless-sliced arch (the default model), not {model.spec.arch!r}")
        idx = torch.tensor(experts, dtype=torch.long)
        for name in EXPERT_PARAMS:
            frozen = getattr(block, name)
            key = f"model.layers.{model.spec.moe_layer_ids[layer]}.mlp.{name}"
            trainable[key] = (frozen, idx, torch.nn.Parameter(frozen.detach()[idx].clone()))
    if not trainable:
        raise ValueError("no experts selected: nothing to train")
    optimizer = torch.optim.AdamW([p for _, _, p in trainable.values()], lr=cfg.lr, weight_decay=0.0)
    losses, start, cpu = [], time.perf_counter(), time.process_time()
    for ids in tqdm(batches(blocks, cfg), total=cfg.steps, desc="ESFT steps", disable=not progress):
        params = {key: frozen.index_put((idx,), rows) for key, (frozen, idx, rows) in trainable.items()}
        loss = functional_call(hf, params, args=(), kwargs={"input_ids": ids, "labels": ids}).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_([p for _, _, p in trainable.values()], 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    with torch.no_grad():
        for frozen, idx, rows in trainable.values():
            frozen[idx] = rows
    stats = {"steps": cfg.steps, "tokens": cfg.steps * cfg.batch * int(blocks.shape[1]),
             "seconds": round(time.perf_counter() - start, 1),
             "cpu_seconds": round(time.process_time() - cpu, 1), **loss_summary(losses)}
    return MoEModel(hf, tokenizer=model.tokenizer), stats
