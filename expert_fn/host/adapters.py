"""LoRA fine-tunes on an expert host: each expert LoRA applied at call time over the shared base
replica (ExpertWeave's way), never merged into a copy.

A LoRA fine-tune's store names every expert by its base's content key (model/lora_store.py), so its
calls compute on the one replica the base (and any other model of those bytes) uses; the factors,
rank r per adapted matrix, are the fine-tune's own memory, held on the compute device while the host
serves it and metered as that model's (meters.Meters.hold_adapter). The compute is the in-process
model's (model/lora.py's LoraExecutor): model/experts.expert_forward_lora over the replica's weights,
so a LoRA fine-tune's outputs through the hosts equal it bit for bit in float32.
"""

from __future__ import annotations

from typing import Callable

import torch

from moeless.expert_fn.host.executor import Weights
from moeless.model.experts import expert_forward, expert_forward_lora

Key = tuple[int, int]
Lora = dict[str, torch.Tensor]


def device_loras(loras: dict[Key, Lora], device: str, dtype: torch.dtype) -> dict[Key, Lora]:
    """Every host key's factors on the compute device in the compute dtype (the replicas' own)."""
    return {key: {n: t.to(device, dtype) for n, t in lora.items()} for key, lora in loras.items()}


def bytes_by_model(loras: dict[Key, Lora], model_of: Callable[[int], int]) -> dict[int, int]:
    """The bytes each model's factors hold (model_of(host layer): its model's index)."""
    out: dict[int, int] = {}
    for (layer, _), lora in loras.items():
        i = model_of(layer)
        out[i] = out.get(i, 0) + sum(t.numel() * t.element_size() for t in lora.values())
    return out


def lora_forward(weights: list[Weights], loras: list[Lora | None], xs: list[torch.Tensor], act: str,
                 out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """executor.sequential_forward with loras[i] (None: none) applied over weights[i]: one expert after
    another, each with the in-process model's kernels; with out ([sum n_i, H]) the outputs are
    copied into its consecutive slices."""
    ys = [expert_forward(w, x, act) if lora is None else expert_forward_lora(w, lora, x, act)
          for w, lora, x in zip(weights, loras, xs)]
    if out is None:
        return ys
    slices = torch.split(out, [x.shape[0] for x in xs])
    for o, y in zip(slices, ys):
        o.copy_(y)
    return list(slices)
