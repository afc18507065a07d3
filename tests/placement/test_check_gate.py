"""The data plane's per-layer check gate (placement/check_gate.py): the docstring's golden example,
then the gate in front of real `actual_shares` calls."""

from __future__ import annotations

import numpy as np
import pytest

from moeless.placement.check_gate import CheckGate, back_off
from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import LayerPlacement

MODEL = LatencyModel(alpha=1e-6, beta=0.0, cold_start=0.0, call_overhead=0.0)
COPIED = LayerPlacement(np.array([0, 1, 2, 3, 0]), np.array([0, 0, 1, 1, 1]), np.array([1.0, 1, 1, 1, 0]))


def test_golden_example_of_the_docstring():
    check_s, window, most = 3.0, 2, 4
    saved, backoff, decisions = [], 0, []
    for record in (10, 0, 0, 0, 0, 8):
        saved = (saved + [record])[-window:]
        backoff = back_off(sum(saved) / len(saved), backoff, check_s, most)
        decisions.append(backoff)
    assert decisions == [0, 0, 1, 2, 4, 0]
    assert back_off(0.0, 4, check_s, most) == 4  # capped at MAX_BACKOFF


def calls(gate: CheckGate, loads, layer=COPIED, phase="decode"):
    return [gate.route(0, phase, np.array(load), layer, MODEL, 2, 1e-6) for load in loads]


def test_copies_that_never_pay_are_checked_ever_less_often_and_route_static_eps_split_meanwhile():
    gate = CheckGate(check_s=1e-6, window=2, max_backoff=4)
    routed = calls(gate, [[2, 2, 2, 2]] * 20)  # even: nothing to gain, every check saves 0
    checked = [r.checked for r in routed]
    # check, skip 1, check, skip 2, check, skip 4, check, skip 4, ...
    assert checked[:12] == [True, False, True, False, False, True, False, False, False, False, True, False]
    assert gate.checks + gate.skips == 20 and gate.checks == sum(checked)
    for r in routed:
        assert not r.paired and r.layer.share.tolist() == [1, 1, 1, 1, 0]  # each expert at home


def test_copies_that_pay_are_checked_on_every_call_and_the_phases_keep_their_own_records():
    gate = CheckGate(check_s=1e-6, window=2, max_backoff=4)
    skewed = calls(gate, [[12, 0, 2, 2]] * 10, phase="prefill")  # GPU 0: 12 tokens, GPU 1: 4: pairing pays
    assert all(r.checked and r.paired for r in skewed)
    assert all(r.saved_s == pytest.approx(12e-6 - 8e-6 - 1e-6) for r in skewed)  # unsplit - floor - relevel_s
    even = calls(gate, [[2, 2, 2, 2]] * 3)  # decode's records are its own: it backs off, prefill does not
    assert [r.checked for r in even] == [True, False, True]
    assert calls(gate, [[12, 0, 2, 2]], phase="prefill")[0].paired


def test_copies_never_held_before_are_checked_at_once_and_one_replica_an_expert_needs_no_check():
    gate = CheckGate(check_s=1e-6, window=2, max_backoff=4)
    two = LayerPlacement(np.array([0, 1, 2, 3, 0, 2]), np.array([0, 0, 1, 1, 1, 0]), np.array([1.0, 1, 1, 1, 0, 0]))
    calls(gate, [[2, 2, 2, 2]] * 3, layer=two)  # backed off: the next call would skip
    # A new object holding the same replicas, then one of them dropped: nothing new, still skipped.
    again = LayerPlacement(two.expert.copy(), two.gpu.copy(), two.share.copy())
    assert [r.checked for r in calls(gate, [[2, 2, 2, 2]], layer=again)] == [False]
    assert [r.checked for r in calls(gate, [[2, 2, 2, 2]], layer=COPIED)] == [False]
    moved = LayerPlacement(np.array([0, 1, 2, 3, 1]), np.array([0, 0, 1, 1, 1]), np.array([1.0, 1, 1, 1, 0]))
    assert calls(gate, [[0, 12, 2, 2]], layer=moved)[0].paired  # expert 1 on GPU 1: never held, checked at once
    static = LayerPlacement(np.arange(4), np.array([0, 0, 1, 1]), np.ones(4))
    assert not gate.route(1, "decode", np.array([9, 0, 0, 0]), static, MODEL, 2, 0.0).checked


def test_max_backoff_zero_checks_every_call_and_bad_knobs_are_refused():
    gate = CheckGate(check_s=1e-6, max_backoff=0)
    assert all(r.checked for r in calls(gate, [[2, 2, 2, 2]] * 5))
    with pytest.raises(ValueError, match="max_backoff >= 0"):
        CheckGate(check_s=1e-6, max_backoff=-1)
    with pytest.raises(ValueError, match="window >= 1"):
        CheckGate(check_s=1e-6, window=0)
