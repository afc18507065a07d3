"""Tiny randomly initialised MoE models of every supported architecture, for tests.

Each has 2-3 decoder layers, hidden size 32, 4-8 experts, k = 2, a 128-token vocabulary and no
tokenizer; the same (arch, seed) always gives the same weights. Configurations exercise each
arch's routing variants: renormalisation, shared experts (and their gate), dense layers among
MoE layers, grouped top-k with score-correction bias, SparseMixer.
"""

from __future__ import annotations

import torch

from moeless.model.moe_model import MoEModel
from moeless.model.sliced_moe import slice_llama

VOCAB = 128
COMMON = dict(
    vocab_size=VOCAB,
    hidden_size=32,
    num_attention_heads=4,
    num_key_value_heads=2,
    max_position_embeddings=256,
    initializer_range=0.1,  # larger than the usual 0.02 so the gates make distinct decisions
    tie_word_embeddings=False,
    bos_token_id=None,
    eos_token_id=None,  # no end-of-sequence: greedy generation always runs max_new_tokens
    pad_token_id=None,
)


def _configs() -> dict:
    from transformers import (
        DeepseekV2Config,
        DeepseekV3Config,
        MixtralConfig,
        OlmoeConfig,
        PhimoeConfig,
        Qwen2MoeConfig,
        Qwen3MoeConfig,
    )

    mla = dict(kv_lora_rank=16, q_lora_rank=None, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_key_value_heads=4)
    return {
        "mixtral": lambda: MixtralConfig(
            **COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2
        ),
        "qwen2_moe": lambda: Qwen2MoeConfig(
            **COMMON, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_experts=8, num_experts_per_tok=2, mlp_only_layers=[1],
        ),
        "qwen3_moe": lambda: Qwen3MoeConfig(
            **COMMON, num_hidden_layers=2, head_dim=8, intermediate_size=48, moe_intermediate_size=16, num_experts=8,
            num_experts_per_tok=2, norm_topk_prob=True,
        ),
        "olmoe": lambda: OlmoeConfig(**COMMON, num_hidden_layers=2, intermediate_size=16, num_experts=8, num_experts_per_tok=2),
        "phimoe": lambda: PhimoeConfig(
            **COMMON, num_hidden_layers=2, intermediate_size=24, num_local_experts=4, num_experts_per_tok=2
        ),
        "deepseek_v2": lambda: DeepseekV2Config(
            **{**COMMON, **mla}, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, topk_method="group_limited_greedy",
            n_group=2, topk_group=1, routed_scaling_factor=1.5,
        ),
        "deepseek_v3": lambda: DeepseekV3Config(
            **{**COMMON, **mla}, num_hidden_layers=3, intermediate_size=48, moe_intermediate_size=16, n_routed_experts=8,
            num_experts_per_tok=2, n_shared_experts=1, first_k_dense_replace=1, n_group=2, topk_group=1,
            routed_scaling_factor=2.5,
        ),
    }


TINY_ARCHS = ("moeless-sliced", "mixtral", "qwen2_moe", "qwen3_moe", "olmoe", "phimoe", "deepseek_v2", "deepseek_v3")


def tiny_hf(arch: str, seed: int = 0):
    """The transformers causal LM behind tiny_model(arch, seed) (float32, eval, eager experts)."""
    from transformers import AutoModelForCausalLM

    if arch == "moeless-sliced":
        return _tiny_sliced(seed)
    configs = _configs()
    if arch not in configs:
        raise ValueError(f"no tiny model for arch {arch!r}; available: {', '.join(TINY_ARCHS)}")
    torch.manual_seed(seed)
    hf = AutoModelForCausalLM.from_config(configs[arch]())
    hf.set_experts_implementation("eager")  # the fastest on CPU (ENVIRONMENT.md)
    if arch == "deepseek_v3":  # a non-zero score-correction bias, so the bias path is exercised
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.normal_(0.0, 0.05)
    return hf.float().eval()


def tiny_model(arch: str, seed: int = 0) -> MoEModel:
    """A tiny random MoEModel of `arch` (one of TINY_ARCHS); deterministic in (arch, seed)."""
    return MoEModel(tiny_hf(arch, seed))


def _tiny_sliced(seed: int, num_experts: int = 4, top_k: int = 2):
    """A tiny random dense Llama, sliced into `num_experts` experts per layer."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    config = LlamaConfig(**COMMON, num_hidden_layers=2, intermediate_size=64)
    hf = LlamaForCausalLM(config)
    layers, f_dense = config.num_hidden_layers, config.intermediate_size
    neurons = torch.stack([torch.randperm(f_dense).reshape(num_experts, -1) for _ in range(layers)])  # [L, E, F]
    routers = torch.randn(layers, num_experts, config.hidden_size) * 0.3  # [L, E, H]
    return slice_llama(hf, neurons, routers, top_k).float().eval()
