"""The model abstraction every part of moeless uses (the contract; moe_model.py implements it).

A model is a Hugging Face causal LM whose MoE blocks are replaced by one dispatching block:
the non-expert part (embeddings, attention + norms + gate per layer, shared experts, LM head)
runs in-process, and the routed experts, addressed as (layer, expert), run wherever an
ExpertExecutor sends them: in-process for the reference, on expert hosts for serving.

Vocabulary (docs/design.md): L MoE layers (layer indices 0..L-1 count MoE layers only), E
experts per layer, k experts per token, H hidden size, F one expert's FFN width, T tokens.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import torch


@dataclass(frozen=True)
class MoESpec:
    """Shape facts of an MoE model."""

    arch: str  # "moeless-sliced" (the default model), "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "deepseek_v2", "deepseek_v3"
    num_layers: int  # L: MoE layers
    num_experts: int  # E
    top_k: int  # k
    hidden_size: int  # H
    expert_ffn: int  # F
    act: str  # expert activation, a key of moeless.model.experts.ACTIVATIONS
    vocab_size: int
    max_positions: int
    moe_layer_ids: tuple[int, ...] = field(default=())  # decoder-layer index of each MoE layer: [L]
    shared_ffn: int = 0  # neurons of the shared experts per layer, run with the non-expert layers (0: none)


@dataclass
class Routing:
    """The gate's decision for T tokens of one layer.

    idx: [T, k] long, experts chosen per token; weight: [T, k] float, their combine weights;
    logits: [T, E] float, the gate's raw scores.
    """

    idx: torch.Tensor
    weight: torch.Tensor
    logits: torch.Tensor

    def on_cpu(self) -> "Routing":
        """This routing with idx and weight in host memory, where the planners read them as numpy
        arrays (one copy each from a GPU); itself when they are there already."""
        if self.idx.is_cpu and self.weight.is_cpu:
            return self
        return Routing(idx=self.idx.cpu(), weight=self.weight.cpu(), logits=self.logits)


class ExpertExecutor(Protocol):
    """Runs the routed experts of one layer; the only thing that differs between the in-process
    reference and the serverless path."""

    def run_layer(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """sum_j routing.weight[t, j] * expert(layer, routing.idx[t, j])(x[t]) for every token t.

        x: [T, H] (the MoE block's input, as the gate sees it) -> [T, H]. Shared experts are not
        included: the model adds them itself.
        """
        ...


@dataclass
class LayerRecord:
    """What one forward call routed through one MoE layer (tokens under the attention mask only).

    gate_input: [T, H] float, hidden states entering the layer's gate; idx: [T, k]; load: [E] int.
    """

    gate_input: torch.Tensor
    idx: torch.Tensor
    load: torch.Tensor


@dataclass
class RoutingCapture:
    """Per forward call (one iteration: a prefill or one decode step), per MoE layer, a LayerRecord.

    iterations[i][l] is layer l of call i. `loads()` stacks them to W: [I, L, E].
    """

    iterations: list[list[LayerRecord]] = field(default_factory=list)

    def loads(self) -> torch.Tensor:
        return torch.stack([torch.stack([r.load for r in it]) for it in self.iterations])
