"""moeless-sliced: neuron-slice experts of a dense Llama FFN."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM

from moeless.model.moe_model import MoEModel
from moeless.model.sliced_moe import SlicedModelError, SlicedMoE, load_sliced, save_sliced, slice_llama

ATOL = 1e-5


def _dense(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=96, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, initializer_range=0.1)
    return LlamaForCausalLM(config).eval()


def _partition(layers: int, f_dense: int, experts: int, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(f_dense, generator=g).reshape(experts, -1) for _ in range(layers)])


def test_block_with_all_experts_equals_the_dense_ffn():
    dense = _dense()
    mlp = dense.model.layers[0].mlp
    neurons = _partition(1, 48, 6)[0]
    block = SlicedMoE.from_dense(mlp, neurons, torch.randn(6, 32), top_k=6, act="silu")
    x = torch.randn(2, 7, 32)
    with torch.no_grad():
        torch.testing.assert_close(block(x), mlp(x), atol=ATOL, rtol=0)


def test_block_with_k_experts_adds_exactly_the_chosen_slices():
    dense = _dense()
    mlp = dense.model.layers[1].mlp
    neurons = _partition(1, 48, 4, seed=3)[0]
    router = torch.randn(4, 32)
    block = SlicedMoE.from_dense(mlp, neurons, router, top_k=2, act="silu")
    x = torch.randn(5, 32)
    with torch.no_grad():
        chosen = torch.topk(x @ router.T, 2).indices
        for t in range(5):
            cols = neurons[chosen[t]].flatten()  # this token's neurons
            h = torch.nn.functional.silu(x[t] @ mlp.gate_proj.weight[cols].T) * (x[t] @ mlp.up_proj.weight[cols].T)
            torch.testing.assert_close(block(x[None, t : t + 1])[0, 0], h @ mlp.down_proj.weight[:, cols].T, atol=ATOL, rtol=0)


def test_sliced_model_with_all_experts_equals_the_dense_model():
    dense = _dense()
    ids = torch.randint(0, 96, (1, 10))
    with torch.no_grad():
        expected = dense(ids).logits
    sliced = slice_llama(dense, _partition(2, 48, 4), torch.randn(2, 4, 32), top_k=4)
    model = MoEModel(sliced)
    assert model.spec.arch == "moeless-sliced" and model.spec.expert_ffn == 12
    torch.testing.assert_close(model.forward(ids).logits, expected, atol=ATOL, rtol=0)


def test_save_and_load_round_trip_with_tokenizer(tmp_path):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {w: i for i, w in enumerate(["<unk>", "hello", "world", "moe"])}
    raw = Tokenizer(models.WordLevel(vocab, unk_token="<unk>"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="<unk>")
    sliced = slice_llama(_dense(), _partition(2, 48, 4), torch.randn(2, 4, 32), top_k=2)
    save_sliced(sliced, tmp_path, tokenizer=tokenizer)
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["moeless"] == {"arch": "moeless-sliced", "num_experts": 4, "top_k": 2, "expert_ffn": 12}
    assert (tmp_path / "tokenizer.json").is_file()
    loaded = load_sliced(tmp_path)
    ids = torch.tensor([tokenizer.encode("hello moe world")])
    with torch.no_grad():
        torch.testing.assert_close(loaded(ids).logits, sliced(ids).logits, atol=0, rtol=0)


def test_tied_embeddings_survive_save_and_load(tmp_path):
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                         num_attention_heads=4, tie_word_embeddings=True)
    sliced = slice_llama(LlamaForCausalLM(config).eval(), _partition(1, 32, 2), torch.randn(1, 2, 32), top_k=1)
    loaded = load_sliced(save_sliced(sliced, tmp_path))
    assert loaded.lm_head.weight.data_ptr() == loaded.model.embed_tokens.weight.data_ptr()
    torch.testing.assert_close(loaded.lm_head.weight, sliced.lm_head.weight, atol=0, rtol=0)


def test_bad_inputs_say_what_is_wrong(tmp_path):
    dense = _dense()
    mlp = dense.model.layers[0].mlp
    with pytest.raises(SlicedModelError, match="partition"):
        SlicedMoE.from_dense(mlp, torch.zeros(4, 12, dtype=torch.long), torch.randn(4, 32), top_k=2, act="silu")
    with pytest.raises(SlicedModelError, match="router weights must be"):
        SlicedMoE.from_dense(mlp, _partition(1, 48, 4)[0], torch.randn(3, 32), top_k=2, act="silu")
    with pytest.raises(SlicedModelError, match="top_k"):
        SlicedMoE(32, 4, 12, top_k=5)
    with pytest.raises(SlicedModelError, match=r"neurons must be \[L=2"):
        slice_llama(dense, _partition(1, 48, 4), torch.randn(1, 4, 32), top_k=2)
    dense.config.hidden_act = "gelu_new"
    with pytest.raises(ValueError, match="expert activation 'gelu_new' is not supported"):
        slice_llama(dense, _partition(2, 48, 4), torch.randn(2, 4, 32), top_k=2)
    with pytest.raises(ValueError, match="unsupported MoE architecture 'llama'; supported: moeless-sliced, mixtral"):
        MoEModel(_dense())
    with pytest.raises(SlicedModelError, match="not a moeless-sliced model"):
        save_sliced(_dense(), tmp_path)
    with pytest.raises(SlicedModelError, match="config.json: missing"):
        load_sliced(tmp_path / "nowhere")
