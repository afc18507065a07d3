"""Routing traces: the prompt-level 7:3 split, the (l, d) views, and the file round trip."""

import pytest
import torch

from moeless.predictor.dataset import TraceError, load_traces, save_traces, split_prompts


def test_split_is_by_prompt_and_identical_prompts_stay_together():
    prompts = [f"question {i}" for i in range(2000)]
    rows = split_prompts(prompts + prompts[:500])  # 500 repeated prompts
    assert len(rows) == 2000
    sides = {}
    for key, side, text in rows:
        assert sides.setdefault(key, side) == side
    train = sum(side == "train" for _, side, _ in rows) / len(rows)
    assert 0.66 < train < 0.74  # 7:3 by hash


def test_collected_traces_never_put_a_prompt_on_both_sides(sliced_traces, prompts):
    train = {t.key for t in sliced_traces.split("train").traces}
    test = {t.key for t in sliced_traces.split("test").traces}
    assert train and test and not train & test
    assert len(train) + len(test) == len(set(prompts))
    fit, val = sliced_traces.split("train").holdout()
    fit_keys, val_keys = {t.key for t in fit.traces}, {t.key for t in val.traces}
    assert fit_keys and val_keys and not fit_keys & val_keys and fit_keys | val_keys == train


def test_pairs_align_source_inputs_with_target_routing(sliced_traces):
    x, x_target, idx = sliced_traces.pairs(0, 1)
    tokens = sliced_traces.num_tokens
    assert x.shape == (tokens, sliced_traces.hidden_size) and x_target.shape == x.shape
    assert idx.shape == (tokens, sliced_traces.top_k)
    first = sliced_traces.traces[0]
    torch.testing.assert_close(x[: first.num_tokens], first.hidden[0].float())
    torch.testing.assert_close(idx[: first.num_tokens], first.idx[1])
    assert int(first.load[1].sum()) == first.num_tokens * sliced_traces.top_k
    with pytest.raises(TraceError, match="outside"):
        sliced_traces.pairs(1, 1)


def test_traces_round_trip_and_refuse_another_model(sliced_traces, tmp_path):
    path = save_traces(sliced_traces, tmp_path / "traces.pt")
    back = load_traces(path, model_hash=sliced_traces.model_hash)
    assert [t.key for t in back.traces] == [t.key for t in sliced_traces.traces]
    torch.testing.assert_close(back.traces[3].hidden, sliced_traces.traces[3].hidden)
    with pytest.raises(TraceError, match="not of this model"):
        load_traces(path, model_hash="0" * 16)


def test_batched_collection_routes_every_prompt_as_if_alone(sliced, sliced_traces, tokenize, prompts):
    from moeless.predictor.collect import collect_traces

    alone = collect_traces(sliced, prompts[:10], tokenize=tokenize, hidden_dtype=torch.float32, batch_size=1, progress=False)
    batched = {t.key: t for t in sliced_traces.traces}
    for trace in alone.traces:
        other = batched[trace.key]
        torch.testing.assert_close(other.hidden, trace.hidden, atol=1e-4, rtol=1e-4)
        assert (other.idx == trace.idx).float().mean() > 0.99
