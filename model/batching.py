"""Batches of token sequences of different lengths."""

from __future__ import annotations

from typing import Sequence

import torch


def left_pad(seqs: Sequence[Sequence[int]], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-pad token id lists into one batch: (ids [B, S], mask [B, S]), S the longest length.

    Left padding keeps every row's last token in the last column, where generation continues.
    """
    width = max(len(s) for s in seqs)
    ids = torch.full((len(seqs), width), pad_id, dtype=torch.long)
    mask = torch.zeros_like(ids)
    for b, s in enumerate(seqs):
        ids[b, width - len(s) :] = torch.as_tensor(list(s), dtype=torch.long)
        mask[b, width - len(s) :] = 1
    return ids, mask
