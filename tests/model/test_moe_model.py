"""MoEModel against each architecture's own transformers forward (tiny random models)."""

from __future__ import annotations

import copy

import pytest
import torch

from moeless.model.adapters import ExpertsDroppedError
from moeless.model.experts import expert_forward
from moeless.model.interface import Routing
from moeless.model.tiny import TINY_ARCHS

ATOL = 1e-5


def _batch(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """Two prompts, the second left-padded by 3: ids [2, 9], mask [2, 9]."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, 128, (2, 9), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :3] = 0
    return ids, mask


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_forward_equals_transformers(tiny, arch):
    model = tiny(arch)
    ids, mask = _batch()
    ours = model.forward(ids, attention_mask=mask).logits
    with torch.no_grad():
        ref = model.hf(input_ids=ids, attention_mask=mask).logits
    keep = mask.bool()
    assert ours.shape == (2, 9, model.spec.vocab_size)
    torch.testing.assert_close(ours[keep], ref[keep], atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_greedy_generation_equals_transformers(tiny, arch):
    model = tiny(arch)
    ids, mask = _batch(1)
    ours = model.generate(ids, max_new_tokens=6, attention_mask=mask)
    ref = model.hf.generate(input_ids=ids, attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(ours, ref)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_spec_matches_model(tiny, arch):
    model = tiny(arch)
    spec = model.spec
    assert spec.arch == arch and spec.top_k == 2
    moe_layers = {"qwen2_moe": (0, 2), "deepseek_v2": (1, 2), "deepseek_v3": (1, 2)}  # tiny.py puts dense layers among these
    assert spec.moe_layer_ids == moe_layers.get(arch, (0, 1)) and spec.num_layers == 2
    assert model.gate(0).weight.shape == (spec.num_experts, spec.hidden_size)
    w = model.expert_weights(spec.num_layers - 1, spec.num_experts - 1)
    assert w["gate"].shape == w["up"].shape == (spec.expert_ffn, spec.hidden_size)
    assert w["down"].shape == (spec.hidden_size, spec.expert_ffn)
    assert len(list(model.iter_experts())) == spec.num_layers * spec.num_experts


@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS if a != "moeless-sliced"])
def test_expert_weights_equal_the_models_own_expert(tiny, arch):
    """expert_forward on expert_weights(l, e) equals the transformers experts module sending
    every token to expert e with weight 1."""
    model = tiny(arch)
    x = torch.randn(5, model.spec.hidden_size)
    for l, decoder_layer in enumerate(model.spec.moe_layer_ids):
        experts = model.hf.model.layers[decoder_layer].mlp.experts
        for e in range(model.spec.num_experts):
            with torch.no_grad():
                ref = experts(x, torch.full((5, 1), e), torch.ones(5, 1))
            ours = expert_forward(model.expert_weights(l, e), x, model.spec.act)
            torch.testing.assert_close(ours, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("arch", [a for a in TINY_ARCHS if a != "moeless-sliced"])
def test_routing_equals_the_transformers_router(tiny, arch):
    """Same experts and combine weights as the arch's own router module (order within a token aside)."""
    model = tiny(arch, seed=3)
    x = torch.randn(64, model.spec.hidden_size)
    for l, decoder_layer in enumerate(model.spec.moe_layer_ids):
        block = model.hf.model.layers[decoder_layer].mlp
        with torch.no_grad():
            logits, weight, idx = (block.router if arch == "phimoe" else block.gate)(x)
            ours = model.route(l, x)
        torch.testing.assert_close(ours.logits, logits, atol=0, rtol=0)
        order, ref_order = ours.idx.argsort(-1), idx.argsort(-1)
        assert torch.equal(ours.idx.gather(1, order), idx.gather(1, ref_order))
        torch.testing.assert_close(ours.weight.gather(1, order), weight.gather(1, ref_order), atol=1e-6, rtol=0)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_cloned_gate_and_routing_from_logits_reproduce_route(tiny, arch):
    model = tiny(arch)
    x = torch.randn(11, model.spec.hidden_size)
    for l in range(model.spec.num_layers):
        clone = copy.deepcopy(model.gate(l))
        assert clone.weight.data_ptr() != model.gate(l).weight.data_ptr()
        with torch.no_grad():
            routing = model.routing_from_logits(l, clone(x))
            direct = model.route(l, x)
        assert routing.idx.shape == routing.weight.shape == (11, model.spec.top_k)
        assert torch.equal(routing.idx, direct.idx)
        assert int(routing.idx.max()) < model.spec.num_experts


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_capture_counts_masked_tokens_only(tiny, arch):
    model = tiny(arch)
    ids, mask = _batch(2)
    real_tokens = int(mask.sum())
    with model.capture() as capture:
        model.forward(ids, attention_mask=mask)
    spec = model.spec
    assert len(capture.iterations) == 1 and len(capture.iterations[0]) == spec.num_layers
    loads = capture.loads()  # [1, L, E]
    assert loads.shape == (1, spec.num_layers, spec.num_experts)
    assert loads.sum(-1).tolist() == [[real_tokens * spec.top_k] * spec.num_layers]
    for l, record in enumerate(capture.iterations[0]):
        assert record.gate_input.shape == (real_tokens, spec.hidden_size)
        with torch.no_grad():
            assert torch.equal(record.idx, model.route(l, record.gate_input).idx)
        assert torch.equal(record.load, torch.bincount(record.idx.flatten(), minlength=spec.num_experts))
    # the first layer's gate input of an unpadded prompt does not depend on the padding of another
    with model.capture() as alone:
        model.forward(ids[1:, 3:])
    first = capture.iterations[0][0].gate_input
    torch.testing.assert_close(alone.iterations[0][0].gate_input, first[9:], atol=ATOL, rtol=0)


def test_capture_records_one_iteration_per_generation_step(tiny):
    model = tiny("mixtral")
    ids = torch.randint(0, 128, (1, 5))
    with model.capture() as capture:
        model.generate(ids, max_new_tokens=4)
    loads = capture.loads()  # [I, L, E]
    assert loads.shape[0] == 4
    assert loads.sum(-1)[:, 0].tolist() == [5 * 2, 2, 2, 2]
    model.forward(ids)
    assert len(capture.iterations) == 4, "forward calls outside the block are not recorded"


def test_a_capture_records_only_its_own_threads_forwards(tiny):
    import threading

    model = tiny("mixtral")
    ids = torch.randint(0, 128, (1, 5))
    started, done = threading.Event(), threading.Event()

    def other_thread() -> None:
        started.wait()
        for _ in range(3):
            model.forward(torch.randint(0, 128, (2, 7)))  # another request served meanwhile
        done.set()

    worker = threading.Thread(target=other_thread)
    worker.start()
    with model.capture() as capture:
        started.set()
        model.forward(ids)
        done.wait(timeout=60)
        model.forward(ids)
    worker.join()
    assert done.is_set() and len(capture.iterations) == 2
    assert capture.loads().sum(-1)[:, 0].tolist() == [5 * 2, 5 * 2]  # 5 tokens x top-2, never the other batch
    with model.capture():
        with pytest.raises(RuntimeError, match="already open"):
            with model.capture():
                pass


class _Recording:
    """An executor that delegates to the local one and records what it was asked."""

    def __init__(self, inner):
        self.inner, self.calls = inner, []

    def run_layer(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        self.calls.append((layer, x.shape[0]))
        return self.inner.run_layer(layer, x, routing)


@pytest.mark.parametrize("arch", ["qwen2_moe", "deepseek_v3"])
def test_executor_sees_every_layer_and_shared_experts_stay_local(tiny, arch):
    model = tiny(arch)
    ids = torch.randint(0, 128, (1, 6))
    rec = _Recording(model.local_executor())
    ours = model.forward(ids, executor=rec).logits
    assert rec.calls == [(l, 6) for l in range(model.spec.num_layers)]
    with torch.no_grad():
        torch.testing.assert_close(ours, model.hf(input_ids=ids).logits, atol=ATOL, rtol=0)
        assert model.shared_forward(0, torch.randn(3, model.spec.hidden_size)).shape == (3, model.spec.hidden_size)


def test_drop_experts_needs_a_remote_executor(tiny):
    model = tiny("mixtral")
    ids = torch.randint(0, 128, (1, 6))
    reference = tiny("mixtral")
    expected = reference.forward(ids).logits
    model.drop_experts()
    with pytest.raises(ExpertsDroppedError, match="remote executor"):
        model.forward(ids)
    torch.testing.assert_close(model.forward(ids, executor=reference.local_executor()).logits, expected, atol=0, rtol=0)
    assert sum(p.numel() for p in model.hf.parameters()) < sum(p.numel() for p in reference.hf.parameters())


def test_unknown_tiny_arch_names_the_available_ones(tiny):
    with pytest.raises(ValueError, match="mixtral"):
        tiny("gpt2")
