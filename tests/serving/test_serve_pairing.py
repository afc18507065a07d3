"""bench/serve_pairing.py: the paired path's placement, its preload and the timed pairing rule."""

import numpy as np
import torch

from moeless.bench.serve_pairing import TimedRelevel, replicated_placement
from moeless.model.interface import Routing
from moeless.placement.latency_model import LatencyModel


def test_every_expert_on_every_host_with_static_homes_first():
    placement = replicated_placement(num_layers=2, num_experts=4, hosts=2)
    for layer in placement.layers:
        assert sorted(zip(layer.expert.tolist(), layer.gpu.tolist())) == [(e, g) for e in range(4) for g in range(2)]
        assert layer.gpu[:4].tolist() == [0, 0, 1, 1] and layer.share.tolist() == [1.0] * 4 + [0.0] * 4


def test_a_skewed_batch_is_paired_and_timed_an_even_one_is_not_paired():
    model = LatencyModel(alpha=1e-6, beta=0.0, cold_start=0.0, call_overhead=1e-6)
    relevel = TimedRelevel(model, relevel_s=1e-6, check_s=1e-7, batch=8)
    layer = replicated_placement(1, 4, 2).layers[0]
    skewed = Routing(idx=torch.tensor([[0, 1]] * 40 + [[2, 3]] * 2), weight=torch.full((42, 2), 0.5), logits=torch.zeros(42, 4))
    shares = relevel(0, layer, skewed, 2)
    tokens = np.bincount(skewed.idx.reshape(-1).numpy(), minlength=4)[shares.expert] * shares.share
    per_host = np.bincount(shares.gpu, weights=tokens, minlength=2)
    assert per_host.tolist() == [42.0, 42.0]  # 80 + 4 tokens evened (past the knee of 1 token, a split)
    even = Routing(idx=torch.tensor([[0, 2], [1, 3]] * 10), weight=torch.full((20, 2), 0.5), logits=torch.zeros(20, 4))
    assert relevel(0, layer, even, 2).share.tolist() == layer.share.tolist()  # nothing to gain: the homes
    summary = relevel.summary()
    assert (summary["calls"], summary["checked_calls"], summary["paired_calls"]) == (2, 2, 1)
    assert summary["us_per_layer_median"] > 0


def test_checks_that_do_not_pay_are_skipped_as_serving_skips_them():
    """The bench times serving's gate too: an even decode batch (rows <= the batch) whose check does
    not pay backs off, so the next calls of that layer and phase skip the check and keep the homes."""
    model = LatencyModel(alpha=1e-6, beta=0.0, cold_start=0.0, call_overhead=1e-6)
    relevel = TimedRelevel(model, relevel_s=1e-6, check_s=1e-3, batch=8)  # a check dearer than any saving
    layer = replicated_placement(1, 4, 2).layers[0]
    even = Routing(idx=torch.tensor([[0, 2], [1, 3]] * 4), weight=torch.full((8, 2), 0.5), logits=torch.zeros(8, 4))
    for _ in range(6):  # check, skip 1, check, skip 2, check (check_gate.py's doubling back-off)
        assert relevel(0, layer, even, 2).share.tolist() == layer.share.tolist()
    summary = relevel.summary()
    assert (summary["calls"], summary["checked_calls"], summary["paired_calls"]) == (6, 3, 0) and relevel.gate.skips == 3
