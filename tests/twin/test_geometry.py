"""Model geometries: the published configs' values against published parameter counts, and the HF
config.json parser on each family."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from moeless.twin.geometry import GEOMETRIES, PUBLISHED, GeometryError, default_geometry, load_geometry, parse_hf_config

# Each model's config.json, the keys the parser reads (values as published at the URL in GEOMETRIES).
CONFIGS = {
    "mixtral-8x7b": {"model_type": "mixtral", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 14336,
                     "num_local_experts": 8, "num_experts_per_tok": 2, "num_attention_heads": 32,
                     "num_key_value_heads": 8, "vocab_size": 32000, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "phi-3.5-moe": {"model_type": "phimoe", "num_hidden_layers": 32, "hidden_size": 4096, "intermediate_size": 6400,
                    "num_local_experts": 16, "num_experts_per_tok": 2, "num_attention_heads": 32, "num_key_value_heads": 8,
                    "vocab_size": 32064, "attention_bias": True, "lm_head_bias": True, "tie_word_embeddings": False,
                    "torch_dtype": "bfloat16"},
    "llama-4-scout": {"model_type": "llama4", "torch_dtype": "bfloat16",
                      "text_config": {"model_type": "llama4_text", "num_hidden_layers": 48, "hidden_size": 5120,
                                      "intermediate_size": 8192, "intermediate_size_mlp": 16384, "num_local_experts": 16,
                                      "num_experts_per_tok": 1, "interleave_moe_layer_step": 1, "num_attention_heads": 40,
                                      "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 202048,
                                      "tie_word_embeddings": False},
                      "vision_config": {"hidden_size": 1408}},
    "deepseek-v2-lite": {"model_type": "deepseek_v2", "num_hidden_layers": 27, "hidden_size": 2048,
                         "intermediate_size": 10944, "moe_intermediate_size": 1408, "n_routed_experts": 64,
                         "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1, "moe_layer_freq": 1,
                         "num_attention_heads": 16, "num_key_value_heads": 16, "kv_lora_rank": 512, "q_lora_rank": None,
                         "qk_nope_head_dim": 128, "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 102400,
                         "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "qwen3-30b-a3b": {"model_type": "qwen3_moe", "num_hidden_layers": 48, "hidden_size": 2048, "intermediate_size": 6144,
                      "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
                      "mlp_only_layers": [], "num_attention_heads": 32, "num_key_value_heads": 4, "head_dim": 128,
                      "vocab_size": 151936, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
    "olmoe-1b-7b": {"model_type": "olmoe", "num_hidden_layers": 16, "hidden_size": 2048, "intermediate_size": 1024,
                    "num_experts": 64, "num_experts_per_tok": 8, "num_attention_heads": 16, "num_key_value_heads": 16,
                    "vocab_size": 50304, "tie_word_embeddings": False, "torch_dtype": "bfloat16"},
}


@pytest.mark.parametrize("name", sorted(PUBLISHED))
def test_parameter_counts_match_the_published_totals(name):
    """Total and active parameters from the config's values and the non-expert formula, within 2%
    of the published figures (rounded to 2-3 digits). Two conventions differ: Llama 4 Scout's 109B
    include the vision encoder (~1B, not counted here: 107.8B); DeepSeek counts active parameters
    without the input embedding (lookups, no FLOPs): 2.66B - 0.21B = 2.45B against "2.4B", which
    itself rounds anything in [2.35, 2.45) (3%)."""
    g, (total, active, _) = GEOMETRIES[name], PUBLISHED[name]
    counted = g.active_params - (g.vocab * g.hidden if name == "deepseek-v2-lite" else 0)
    assert g.total_params == pytest.approx(total, rel=0.02)
    assert counted == pytest.approx(active, rel=0.03 if name == "deepseek-v2-lite" else 0.02)


def test_mixtral_by_hand():
    """Mixtral-8x7B: an expert is 3 x 4096 x 14336 = 176,160,768 parameters (352 MB in bf16); the
    non-expert part is embeddings and head 2 x 32000 x 4096 = 262,144,000, attention 32 x (2 x 4096 x
    4096 + 2 x 4096 x 1024) = 1,342,177,280, routers 32 x 4096 x 8 = 1,048,576, norms 65 x 4096 =
    266,240: 1,605,636,096 in all, 46.70B total."""
    g = load_geometry("Mixtral-8x7B")
    assert g.expert_params == 176_160_768 and g.expert_bytes == 352_321_536
    assert g.non_expert_params == 262_144_000 + 1_342_177_280 + 1_048_576 + 266_240
    assert g.non_expert_bytes == 2 * g.non_expert_params


@pytest.mark.parametrize("name", sorted(CONFIGS))
def test_hf_config_of_each_family_parses_to_the_listed_geometry(tmp_path: Path, name):
    path = tmp_path / name / "config.json"
    path.parent.mkdir()
    path.write_text(json.dumps(CONFIGS[name]))
    parsed, listed = load_geometry(path.parent), GEOMETRIES[name]
    assert parsed.name == name and parsed.source == str(path)
    for field in ("num_layers", "moe_layers", "num_experts", "top_k", "hidden", "expert_ffn", "dtype",
                  "shared_experts", "shared_ffn", "non_expert_params", "total_params"):
        assert getattr(parsed, field) == getattr(listed, field), field


def test_qwen2_moe_shared_expert_and_dense_layers_from_config(tmp_path: Path):
    """Qwen2-MoE style: one gated shared expert of its own size, layers listed in mlp_only_layers
    and off the decoder_sparse_step stay dense."""
    doc = {"model_type": "qwen2_moe", "num_hidden_layers": 4, "hidden_size": 8, "intermediate_size": 32,
           "moe_intermediate_size": 4, "shared_expert_intermediate_size": 16, "num_experts": 6, "num_experts_per_tok": 2,
           "decoder_sparse_step": 1, "mlp_only_layers": [0], "num_attention_heads": 2, "vocab_size": 10}
    (tmp_path / "config.json").write_text(json.dumps(doc))
    g = parse_hf_config(tmp_path / "config.json")
    assert (g.moe_layers, g.shared_experts, g.shared_ffn, g.dense_ffn, g.shared_expert_gate) == (3, 1, 16, 32, True)
    # embeddings + head 160, final norm 8; per layer attention 4*64 + 2 norms 16; per MoE layer router 48,
    # shared 3*8*16 = 384 and its gate 8; one dense layer 3*8*32 = 768.
    assert g.non_expert_params == 160 + 8 + 4 * (256 + 16) + 3 * (48 + 384 + 8) + 768


def test_default_geometry_is_smollm2_moefied():
    """SmolLM2-135M (134.5M parameters) plus the routers (30 x 16 x 576): its FFN neurons are only
    regrouped into the shared expert (768) and 16 experts of 48."""
    g = default_geometry()
    assert (g.num_experts, g.top_k, g.expert_ffn, g.shared_ffn, g.dtype) == (16, 8, 48, 768, "float32")
    assert g.total_params - 30 * 16 * 576 == pytest.approx(134.5e6, rel=0.005)
    assert default_geometry(32, 4).expert_ffn == 24


def test_unknown_names_and_bad_configs_are_clear_errors(tmp_path: Path):
    with pytest.raises(GeometryError, match="mixtral-8x7b, phi-3.5-moe"):
        load_geometry("gpt-5")
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "llama", "num_hidden_layers": 2, "hidden_size": 8}))
    with pytest.raises(GeometryError, match="lacks num_local_experts / n_routed_experts"):
        load_geometry(tmp_path / "config.json")
    with pytest.raises(GeometryError, match="no such config.json"):
        load_geometry(tmp_path / "missing.json")


def test_deepseek_v3_and_llama4_interleaved_layers_from_config(tmp_path: Path):
    """DeepSeek-V3's keys: q through its low rank, a router bias; Llama 4 Maverick's MoE every other
    layer (interleave_moe_layer_step 2: layers 1, 3, ...), its dense layers of intermediate_size_mlp."""
    v3 = {"model_type": "deepseek_v3", "num_hidden_layers": 4, "hidden_size": 8, "intermediate_size": 32,
          "moe_intermediate_size": 4, "n_routed_experts": 8, "n_shared_experts": 1, "num_experts_per_tok": 2,
          "first_k_dense_replace": 1, "moe_layer_freq": 1, "num_attention_heads": 2, "kv_lora_rank": 4, "q_lora_rank": 6,
          "qk_nope_head_dim": 2, "qk_rope_head_dim": 1, "v_head_dim": 2, "vocab_size": 10, "torch_dtype": "float8_e4m3fn"}
    (tmp_path / "config.json").write_text(json.dumps(v3))
    g = load_geometry(tmp_path / "config.json")
    assert (g.moe_layers, g.shared_ffn, g.router_bias, g.dtype, g.dtype_bytes) == (3, 4, True, "float8", 1)
    # q: 8*6 + 6 + 6*2*3 = 90; kv: 8*(4+1) + 4 + 4*2*(2+2) = 76; o: 2*2*8 = 32.
    assert g.non_expert_params == 80 + 80 + 8 + 4 * (90 + 76 + 32 + 16) + 3 * (64 + 8 + 96) + 768
    maverick = {"model_type": "llama4", "text_config": {
        "model_type": "llama4_text", "num_hidden_layers": 4, "hidden_size": 8, "intermediate_size": 4,
        "intermediate_size_mlp": 16, "num_local_experts": 4, "num_experts_per_tok": 1, "interleave_moe_layer_step": 2,
        "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 4, "vocab_size": 10}}
    (tmp_path / "config.json").write_text(json.dumps(maverick))
    g = load_geometry(tmp_path)
    assert (g.moe_layers, g.shared_experts, g.shared_ffn, g.dense_ffn) == (2, 1, 4, 16)
