"""The default model's shape, without importing torch (the CLI's --help and other packages read it).

SmolLM2-135M's FFNs have 1536 SwiGLU neurons over a hidden size of 576. The default MoE splits
each into a shared expert of 768 neurons (run on every token) and 16 routed experts of 48
neurons, 8 routed experts per token (docs/model.md, "Choosing the default").
"""

from __future__ import annotations

SOURCE_HIDDEN, SOURCE_FFN = 576, 1536  # SmolLM2-135M's hidden size H and FFN neurons per layer (tested)
DEFAULT_EXPERTS, DEFAULT_SHARED, DEFAULT_TOP_K = 16, 768, 8  # E routed experts, S shared neurons, k
# (H, F) of one routed expert of the default model: what an expert host loads and runs.
DEFAULT_EXPERT_SHAPE = (SOURCE_HIDDEN, (SOURCE_FFN - DEFAULT_SHARED) // DEFAULT_EXPERTS)
