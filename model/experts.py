"""The canonical expert: a SwiGLU FFN, the unit that expert functions load and run.

Every supported architecture's expert is converted to this form, so that the expert host,
the weight store and the in-process reference share one definition.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

# Tensor names of one expert, with shapes (F = expert FFN width, H = hidden size).
EXPERT_TENSORS = ("gate", "up", "down")  # gate: [F, H], up: [F, H], down: [H, F]

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
