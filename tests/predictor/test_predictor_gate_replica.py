"""Gate-module predictors: at distance 0 they are the gate, on every supported architecture."""

import numpy as np
import pytest
import torch

from moeless.model.tiny import TINY_ARCHS, tiny_model
from moeless.predictor.collect import collect_traces
from moeless.predictor.evaluate import by_distance, replay
from moeless.predictor.gate_replica import all_pairs, gate_reuse, rescaled_gate_copies


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_distance_zero_reproduces_the_gate_exactly(arch, tokenize, prompts):
    model = tiny_model(arch, seed=0)
    traces = collect_traces(model, prompts[:12], tokenize=tokenize, hidden_dtype=torch.float32, progress=False)
    L = model.spec.num_layers
    predictor = gate_reuse(model, [(l, 0) for l in range(L)])
    for trace in traces.traces:
        for l in range(L):
            forecast = predictor.predict(l, 0, trace.hidden[l], trace.trajectory[: l + 1].numpy())
            np.testing.assert_array_equal(forecast.topk, trace.idx[l].numpy())
            np.testing.assert_array_equal(forecast.load, trace.load[l].numpy())


def test_gate_copies_are_independent_of_the_model(sliced):
    predictor = gate_reuse(sliced, [(0, 1)])
    with torch.no_grad():
        predictor.modules[(0, 1)].weight.zero_()
    assert sliced.gate(1).weight.abs().sum() > 0
    assert predictor.nbytes() == sliced.gate(1).weight.numel() * 4


def test_replay_scores_distance_zero_perfectly_and_distance_one_less(sliced, sliced_traces):
    pairs = all_pairs(sliced.spec.num_layers, [0, 1])
    scores = by_distance(replay(gate_reuse(sliced, pairs), sliced_traces.split("test"), pairs))
    assert scores[0]["topk_hit"] == 1.0 and scores[0]["load_acc"] == 1.0 and scores[0]["straggler"] == 1.0
    assert scores[1]["topk_hit"] < 1.0


def test_unknown_pair_and_bad_pairs_are_clear_errors(sliced):
    with pytest.raises(KeyError, match="no predictor for layer 1 at distance 0"):
        gate_reuse(sliced, [(0, 1)]).predict(1, 0, torch.zeros(3, sliced.spec.hidden_size), np.zeros((2, 4)))
    with pytest.raises(ValueError, match="l \\+ d < L"):
        gate_reuse(sliced, [(1, 1)])


def test_rescaled_copies_see_layer_l_inputs_at_layer_l_plus_d_scale(sliced, sliced_traces):
    copies = rescaled_gate_copies(sliced, sliced_traces, [(0, 0), (0, 1)])
    torch.testing.assert_close(copies[(0, 0)].weight, sliced.gate(0).weight, rtol=0, atol=0)  # d = 0: the gate itself
    x = sliced_traces.traces[0].hidden[0]
    ratio = sliced_traces.channel_rms(1) / sliced_traces.channel_rms(0)
    with torch.no_grad():
        torch.testing.assert_close(copies[(0, 1)](x), sliced.gate(1)(x * ratio))
    all_tokens = torch.cat([t.hidden[1] for t in sliced_traces.traces])
    torch.testing.assert_close(sliced_traces.channel_rms(1), all_tokens.pow(2).mean(0).sqrt())
