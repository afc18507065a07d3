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


def _shared_split(layers: int, f_dense: int, shared: int, experts: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Per layer a random shared set and a partition of the rest: (shared [L, S], neurons [L, E, F])."""
    g = torch.Generator().manual_seed(seed)
    perms = [torch.randperm(f_dense, generator=g) for _ in range(layers)]
    return torch.stack([p[:shared] for p in perms]), torch.stack([p[shared:].reshape(experts, -1) for p in perms])


def test_shared_expert_runs_on_every_token_beside_the_chosen_slices():
    dense = _dense()
    mlp = dense.model.layers[0].mlp
    shared, neurons = _shared_split(1, 48, 16, 4, seed=2)
    router = torch.randn(4, 32)
    block = SlicedMoE.from_dense(mlp, neurons[0], router, top_k=1, act="silu", shared=shared[0])
    assert block.shared_ffn == 16 and block.gate_proj.shape == (4, 8, 32)
    x = torch.randn(6, 32)
    with torch.no_grad():
        chosen = torch.topk(x @ router.T, 1).indices
        for t in range(6):
            cols = torch.cat([shared[0], neurons[0][chosen[t, 0]]])  # the shared neurons, then the routed ones
            h = torch.nn.functional.silu(x[t] @ mlp.gate_proj.weight[cols].T) * (x[t] @ mlp.up_proj.weight[cols].T)
            torch.testing.assert_close(block(x[None, t : t + 1])[0, 0], h @ mlp.down_proj.weight[:, cols].T, atol=ATOL, rtol=0)


def test_sliced_model_with_shared_expert_and_all_routed_equals_the_dense_model(tmp_path):
    dense = _dense()
    ids = torch.randint(0, 96, (2, 10))
    with torch.no_grad():
        expected = dense(ids).logits
    shared, neurons = _shared_split(2, 48, 24, 4)
    sliced = slice_llama(dense, neurons, torch.randn(2, 4, 32), top_k=4, shared=shared)
    model = MoEModel(sliced)
    assert (model.spec.expert_ffn, model.spec.shared_ffn, model.spec.num_experts) == (6, 24, 4)
    torch.testing.assert_close(model.forward(ids).logits, expected, atol=ATOL, rtol=0)
    # The shared expert is not a routed expert: the weight store gets the routed ones only, and
    # dropping them leaves it in place (the serving replicas run it with the non-expert layers).
    assert {tuple(w["gate"].shape) for _, _, w in model.iter_experts()} == {(6, 32)}
    loaded = MoEModel(load_sliced(save_sliced(sliced, tmp_path)))
    assert json.loads((tmp_path / "config.json").read_text())["moeless"]["shared_ffn"] == 24
    torch.testing.assert_close(loaded.forward(ids).logits, expected, atol=ATOL, rtol=0)
    loaded.drop_experts()
    x = torch.randn(3, 32)
    torch.testing.assert_close(loaded.shared_forward(1, x), model.shared_forward(1, x), atol=0, rtol=0)


def test_sliced_model_with_shared_expert_routes_and_generates_like_its_own_forward():
    shared, neurons = _shared_split(2, 48, 16, 4, seed=5)
    sliced = slice_llama(_dense(1), neurons, torch.randn(2, 4, 32), top_k=2, shared=shared)
    model = MoEModel(sliced)
    ids = torch.randint(0, 96, (1, 8))
    with torch.no_grad():
        ref = sliced(ids).logits  # SlicedMoE.forward: routed slices + shared expert
    torch.testing.assert_close(model.forward(ids).logits, ref, atol=ATOL, rtol=0)
    assert torch.equal(model.generate(ids, 5), sliced.generate(ids, max_new_tokens=5, do_sample=False))


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
    assert config["moeless"] == {"arch": "moeless-sliced", "num_experts": 4, "top_k": 2, "expert_ffn": 12, "shared_ffn": 0}
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
    shared, neurons = _shared_split(1, 48, 8, 4)
    with pytest.raises(SlicedModelError, match="partition"):  # a shared neuron also in a routed expert
        SlicedMoE.from_dense(mlp, neurons[0], torch.randn(4, 32), top_k=2, act="silu", shared=neurons[0, 0, :8])
    with pytest.raises(SlicedModelError, match=r"shared must be \[L=2"):
        slice_llama(dense, _shared_split(2, 48, 8, 4)[1], torch.randn(2, 4, 32), top_k=2, shared=shared)
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
