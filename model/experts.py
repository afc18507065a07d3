"""The canonical expert: a SwiGLU FFN, the unit that expert functions load and run.

Every supported architecture's expert is converted to this form, so that the expert host,
the weight store and the in-process reference share one definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tensor names of one expert, with shapes (F = expert FFN width, H = hidden size).
EXPERT_TENSORS = ("gate", "up", "down")  # gate: [F, H], up: [F, H], down: [H, F]


def lora_tensor_names(name: str) -> tuple[str, str]:
    """The LoRA factors of expert tensor `name` in an expert LoRA dict: ("<name>_A", "<name>_B")."""
    return f"{name}_A", f"{name}_B"

ACTIVATIONS = {"silu": F.silu, "gelu": F.gelu, "gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}


def activation(name: str):
    """The activation function called `name`; a clear error for unknown names."""
    try:
        return ACTIVATIONS[name]
    except KeyError:
        raise ValueError(f"unknown expert activation {name!r}; known: {sorted(ACTIVATIONS)}") from None


def expert_forward(weights: dict[str, torch.Tensor], x: torch.Tensor, act: str = "silu",
                   out: torch.Tensor | None = None) -> torch.Tensor:
    """down(act(gate x) * up x).

    weights: {"gate": [F, H], "up": [F, H], "down": [H, F]}; x: [T, H] -> [T, H], written into
    `out` ([T, H], contiguous) when given: the same kernel, so the same bits.
    """
    h = activation(act)(x @ weights["gate"].T) * (x @ weights["up"].T)
    return torch.matmul(h, weights["down"].T, out=out)


def _lora_linear(x: torch.Tensor, weight: torch.Tensor, lora: dict[str, torch.Tensor], name: str) -> torch.Tensor:
    """x @ W.T, plus (x @ A.T) @ B.T when `lora` has factors for `name`."""
    y = x @ weight.T
    a, b = lora_tensor_names(name)
    if a in lora:
        y = y + (x @ lora[a].T) @ lora[b].T
    return y


def expert_forward_lora(weights: dict[str, torch.Tensor], lora: dict[str, torch.Tensor], x: torch.Tensor,
                        act: str = "silu") -> torch.Tensor:
    """expert_forward with a LoRA applied at call time over the unchanged base weights (ExpertWeave's
    way): each adapted matrix W computes x W^T + (x A^T) B^T, so one base replica in memory serves
    the base model and any number of LoRA fine-tunes, and no merged copy is ever made.

    weights: {"gate": [F, H], "up": [F, H], "down": [H, F]}; lora: for any of those names m,
    "m_A" [r, in] and "m_B" [out, r] with the LoRA scaling (alpha / r) already in B
    (moeless.model.lora.expert_loras reads them so from a PEFT adapter); x: [T, H] -> [T, H].
    Deterministic (no reduction order depends on anything but the shapes). Equal to expert_forward
    over the merged weights W + B A up to float rounding, not bit for bit.
    """
    h = activation(act)(_lora_linear(x, weights["gate"], lora, "gate")) * _lora_linear(x, weights["up"], lora, "up")
    return _lora_linear(h, weights["down"], lora, "down")
