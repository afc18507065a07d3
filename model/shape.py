"""Model shapes, without importing torch: the default model's (the CLI's --help and other packages
read it) and a loaded model's expert shape and non-expert bytes (`model_facts`: what a cost profile
needs of it).

SmolLM2-135M's FFNs have 1536 SwiGLU neurons over a hidden size of 576. The default MoE splits
each into a shared expert of 768 neurons (run on every token) and 16 routed experts of 48
neurons, 8 routed experts per token (docs/model.md, "Choosing the default").
"""

from __future__ import annotations

from dataclasses import dataclass

SOURCE_HIDDEN, SOURCE_FFN = 576, 1536  # SmolLM2-135M's hidden size H and FFN neurons per layer (tested)
DEFAULT_EXPERTS, DEFAULT_SHARED, DEFAULT_TOP_K = 16, 768, 8  # E routed experts, S shared neurons, k
# (H, F) of one routed expert of the default model: what an expert host loads and runs.
DEFAULT_EXPERT_SHAPE = (SOURCE_HIDDEN, (SOURCE_FFN - DEFAULT_SHARED) // DEFAULT_EXPERTS)


@dataclass(frozen=True)
class ModelFacts:
    """What the cost profile needs of the model: expert shape (H, F) and non-expert bytes (float32)."""

    hidden: int
    ffn: int
    non_expert_bytes: int


def model_facts(model) -> ModelFacts:
    """Expert shape and non-expert bytes of a MoEModel (routed experts excluded, float32)."""
    ffn, hidden = model.expert_weights(0, 0)["gate"].shape
    params = {id(p): p for p in model.hf.parameters()}  # tied weights counted once
    total = sum(p.numel() for p in params.values())
    experts = model.spec.num_layers * model.spec.num_experts * 3 * hidden * ffn
    return ModelFacts(int(hidden), int(ffn), 4 * max(total - experts, 0))
