"""Quality measures of a converted model: perplexity on real prompts and per-layer load skew."""

from __future__ import annotations

import math
from typing import Callable

import torch

from moeless.model.default import padded_batches


@torch.no_grad()
def perplexity(logits_of: Callable[[torch.Tensor, torch.Tensor], torch.Tensor], seqs: list[torch.Tensor], batch_size: int = 8) -> float:
    """exp(mean next-token cross-entropy) over all real tokens of seqs.

    logits_of(ids [B, S], mask [B, S]) -> logits [B, S, V]; seqs: list of [S_i] long.
    """
    total, count = 0.0, 0
    for ids, mask in padded_batches(seqs, batch_size, pad_id=0):
        logits = logits_of(ids, mask)[:, :-1]
        labels = ids[:, 1:].masked_fill(mask[:, 1:] == 0, -100)
        loss = torch.nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), labels.reshape(-1), ignore_index=-100, reduction="sum")
        total += float(loss)
        count += int((labels != -100).sum())
    if not count:
        raise ValueError("perplexity needs sequences of at least 2 tokens")
    return math.exp(total / count)


def load_skew(loads: torch.Tensor) -> torch.Tensor:
    """Per layer, max / mean tokens per expert (1.0 = perfectly even).

    loads: [..., L, E] token counts (leading dimensions are summed) -> [L].
    """
    per_layer = loads.reshape(-1, *loads.shape[-2:]).sum(dim=0).double()
    return per_layer.max(dim=-1).values / per_layer.mean(dim=-1).clamp_min(1e-12)
