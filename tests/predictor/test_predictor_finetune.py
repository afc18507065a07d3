"""Layer-aware fine-tuning: only weak layers are trained, and none ends worse on held-out prompts."""

import pytest
import torch

from moeless.predictor.finetune import FitConfig, hit_rate, layer_aware_finetune, pair_data
from moeless.predictor.gate_replica import all_pairs, gate_route, rescaled_gate_copies
from moeless.predictor.scratch import train_scratch


@pytest.fixture(scope="module")
def split(sliced_traces):
    return sliced_traces.split("train").holdout()


def test_finetuning_never_lowers_held_out_accuracy(sliced, split):
    fit, val = split
    pairs = all_pairs(sliced.spec.num_layers, [0, 1])
    # A threshold nobody reaches and a reckless learning rate: every pair trains, most epochs hurt.
    config = FitConfig(threshold=1.01, max_epochs=6, lr=0.5, batch_size=32)
    predictor, reports = layer_aware_finetune(sliced, fit, val, pairs, config, progress=False)
    route = gate_route(sliced)
    start = rescaled_gate_copies(sliced, fit, pairs)
    for pair in pairs:
        data = pair_data(sliced, val, pair)
        original = hit_rate(start[pair], route, sum(pair), data)
        after = hit_rate(predictor.modules[pair], route, sum(pair), data)
        assert reports[pair].before == pytest.approx(original)
        assert reports[pair].after == pytest.approx(after)
        assert after >= original


def test_only_layers_under_the_threshold_are_trained_until_they_reach_it(sliced, split):
    fit, val = split
    config = FitConfig(threshold=0.95, max_epochs=30, lr=3e-2, batch_size=64)
    predictor, reports = layer_aware_finetune(sliced, fit, val, [(0, 0), (0, 1)], config, progress=False)
    # distance 0 is the gate itself (accuracy 1.0): profiled, never trained, weights untouched
    assert reports[(0, 0)].epochs == 0 and not reports[(0, 0)].tuned
    torch.testing.assert_close(predictor.modules[(0, 0)].weight, sliced.gate(0).weight)
    # distance 1 starts under the threshold and gains by training
    weak = reports[(0, 1)]
    assert weak.before < 0.95 and weak.epochs > 0 and weak.tuned and weak.after > weak.before
    assert weak.after >= 0.95 or weak.epochs == config.max_epochs


def test_an_exhausted_time_budget_leaves_the_gates_as_they_are(sliced, split):
    fit, val = split
    predictor, reports = layer_aware_finetune(sliced, fit, val, [(0, 1)], FitConfig(threshold=1.01, time_budget_s=0.0), progress=False)
    assert reports[(0, 1)].epochs == 0 and reports[(0, 1)].after == reports[(0, 1)].before
    torch.testing.assert_close(predictor.modules[(0, 1)].weight, rescaled_gate_copies(sliced, fit, [(0, 1)])[(0, 1)].weight)


def test_scratch_mlp_is_larger_than_a_gate_and_learns_something(sliced, split):
    fit, val = split
    mlp, reports = train_scratch(sliced, fit, val, [(0, 1)], FitConfig(max_epochs=5, lr=1e-2), width=64, progress=False)
    assert mlp.nbytes() > sliced.gate(1).weight.numel() * 4
    assert reports[(0, 1)].epochs == 5
    assert reports[(0, 1)].after > 2 / sliced.spec.num_experts  # better than a random pick of k=2 of 4
