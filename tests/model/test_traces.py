"""Routing traces: per-request prefill and decode loads, and their .npz files."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from moeless.traces.request_loads import RequestLoads, TraceError, load_request_loads, request_loads, save_request_loads


def test_loads_follow_the_models_own_routing(tiny):
    model = tiny("qwen2_moe")
    prompts = [torch.randint(0, 128, (7,)), [5, 9, 11]]
    requests = request_loads(model, prompts, max_new_tokens=4)
    spec = model.spec
    assert [r.prompt_tokens for r in requests] == [7, 3]
    for r, n in zip(requests, (7, 3)):
        assert r.prefill.shape == (spec.num_layers, spec.num_experts)
        assert r.decode.shape == (4, spec.num_layers, spec.num_experts)
        assert (r.prefill.sum(-1) == n * spec.top_k).all()
        assert (r.decode.sum(-1) == spec.top_k).all()
    # the prefill loads are the capture of a plain forward over the prompt
    with model.capture() as capture:
        model.forward(torch.tensor([[5, 9, 11]]))
    assert np.array_equal(requests[1].prefill, capture.loads()[0].numpy())
    # decode row s routes generated token s: replay the greedy continuation as one prefill
    ids = model.generate(torch.tensor([[5, 9, 11]]), 4)
    with model.capture() as replay:
        model.forward(ids)
    last_layer = spec.num_layers - 1
    for s in range(4):
        token_idx = replay.iterations[0][last_layer].idx[3 + s]
        assert np.array_equal(np.flatnonzero(requests[1].decode[s, last_layer]), np.sort(token_idx.numpy()))


def test_batching_does_not_change_any_requests_loads(tiny):
    model = tiny("deepseek_v3")
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, 128, (int(n),), generator=g) for n in (9, 2, 5, 12, 5)]
    alone = request_loads(model, prompts, max_new_tokens=3, batch_size=1)
    batched = request_loads(model, prompts, max_new_tokens=3, batch_size=3)
    assert [r.prompt_tokens for r in batched] == [9, 2, 5, 12, 5]
    for a, b in zip(alone, batched):
        assert np.array_equal(a.prefill, b.prefill) and np.array_equal(a.decode, b.decode)
    (no_decode,) = request_loads(model, prompts[:1], max_new_tokens=0)
    assert no_decode.decode.shape == (0, 2, 8) and np.array_equal(no_decode.prefill, alone[0].prefill)


def test_save_and_load_round_trip(tmp_path, tiny):
    requests = request_loads(tiny("mixtral"), [[1, 2, 3, 4], [7, 8]], max_new_tokens=3)
    requests.append(RequestLoads(prefill=requests[0].prefill, decode=requests[0].decode[:0], prompt_tokens=4))
    loaded = load_request_loads(save_request_loads(tmp_path / "t.npz", requests))
    assert len(loaded) == 3
    for a, b in zip(requests, loaded):
        assert np.array_equal(a.prefill, b.prefill) and np.array_equal(a.decode, b.decode)
        assert a.prompt_tokens == b.prompt_tokens
    assert loaded[2].decode.shape == (0, 2, 4)


def test_text_prompts_need_a_tokenizer_and_files_are_checked(tmp_path, tiny):
    model = tiny("mixtral")
    with pytest.raises(TraceError, match="no tokenizer"):
        request_loads(model, ["hello"], max_new_tokens=1)
    with pytest.raises(TraceError, match="empty prompt"):
        request_loads(model, [[]], max_new_tokens=1)
    with pytest.raises(TraceError, match="no such trace file"):
        load_request_loads(tmp_path / "absent.npz")
    np.savez(tmp_path / "other.npz", x=np.zeros(3))
    with pytest.raises(TraceError, match="not a routing trace file"):
        load_request_loads(tmp_path / "other.npz")


def test_text_prompts_and_stop_at_eos(tiny):
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    model = tiny("olmoe")
    words = [f"w{i}" for i in range(128)]
    raw = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="w0"))
    raw.pre_tokenizer = pre_tokenizers.Whitespace()
    prompt = "w5 w17 w99"
    continuation = model.generate(torch.tensor([[5, 17, 99]]), 6)[0, 3:].tolist()
    eos = continuation[2]
    first_eos = continuation.index(eos)  # the greedy continuation may repeat tokens
    model.tokenizer = PreTrainedTokenizerFast(tokenizer_object=raw, unk_token="w0", eos_token=words[eos])
    (stopped,) = request_loads(model, [prompt], max_new_tokens=5)
    assert stopped.prompt_tokens == 3 and len(stopped.decode) == first_eos
    (full,) = request_loads(model, [prompt], max_new_tokens=5, stop_at_eos=False)
    assert len(full.decode) == 5
    assert np.array_equal(full.decode[:first_eos], stopped.decode) and np.array_equal(full.prefill, stopped.prefill)
