"""The Expert Scaler: the paper's CV rule, moeless's straggler rule, bounds and the dead-band."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from moeless.placement.scaler import (
    ReplicaStats,
    active_cv_below,
    cv_below,
    greedy_scale,
    replica_cv,
    straggler_within,
    with_dead_band,
)

loads = st.lists(st.integers(0, 500), min_size=1, max_size=24).map(lambda v: np.array(v, dtype=np.float64))
SETTINGS = settings(max_examples=60, deadline=None)


def reference_scale(load, budget, stop, limit):
    """Slow, obvious version: one replica each, then argmax of per-replica load until stop/budget."""
    cnt = np.ones(load.size, dtype=np.int64)
    while cnt.sum() < budget:
        per = np.where(cnt < limit, load / cnt, -1.0)  # experts at their limit cannot grow
        stats = ReplicaStats(int(cnt.sum()), int(cnt[load == 0].sum()), float(load.sum()), float((load * load / cnt).sum()), float(per.max()))
        if per.max() <= 0 or stop(stats):
            break
        cnt[int(np.argmax(per))] += 1
    return cnt


@SETTINGS
@given(load=loads, extra=st.integers(0, 30), threshold=st.floats(0.0, 1.5), limit=st.integers(1, 8))
def test_paper_rule_stops_at_threshold_unless_the_cap_or_limits_stop_it(load, extra, threshold, limit):
    budget = load.size + extra
    cnt = greedy_scale(load, budget, cv_below(threshold), max_replicas=limit)
    assert (cnt >= 1).all() and (cnt <= limit).all() and cnt.sum() <= budget
    capped = cnt.sum() == budget or all(cnt[load > 0] == limit)
    assert replica_cv(load, cnt) <= threshold + 1e-9 or capped
    assert np.array_equal(cnt, reference_scale(load, budget, cv_below(threshold), limit))


@SETTINGS
@given(load=loads, extra=st.integers(0, 30), call=st.floats(0.0, 100.0), gpus=st.integers(1, 16))
def test_straggler_rule_stops_once_the_largest_replica_fits_the_balanced_bound(load, extra, call, gpus):
    budget = load.size + extra
    rule = straggler_within(gpus, 0.0, call)
    cnt = greedy_scale(load, budget, rule, max_replicas=gpus)
    assert (cnt >= 1).all() and (cnt <= gpus).all() and cnt.sum() <= budget
    stats = ReplicaStats.of(load, cnt)
    capped = cnt.sum() == budget or all(cnt[load > 0] == gpus)
    assert rule(stats) or capped
    assert np.array_equal(cnt, reference_scale(load, budget, rule, gpus))


def test_decode_like_load_idle_experts_keep_the_paper_cv_high_but_not_the_active_cv():
    load = np.array([40.0, 30.0, 20.0, 10.0, 0, 0, 0, 0])  # half the experts idle, as in decode
    paper = greedy_scale(load, 16, cv_below(0.2))
    active = greedy_scale(load, 16, active_cv_below(0.2))
    assert paper.sum() == 16  # the memory cap, not balance, stopped it
    assert replica_cv(load, paper) > 0.2
    assert active.sum() < 16 and replica_cv(load, active, active_only=True) <= 0.2


def test_straggler_rule_replicates_only_experts_above_the_balanced_load():
    load = np.array([400.0, 100.0, 100.0, 100.0, 50.0, 50.0, 0.0, 0.0])  # total 800, 8 GPUs: 100 each
    cnt = greedy_scale(load, 64, straggler_within(8))
    assert cnt.tolist() == [4, 1, 1, 1, 1, 1, 1, 1]


def test_call_overhead_stops_replication_that_would_stack_calls():
    load = np.array([20.0, 10, 8, 8, 6, 6, 4, 2])  # every GPU already runs one expert
    assert greedy_scale(load, 64, straggler_within(8, 0.0, 0.0)).sum() > 8
    assert greedy_scale(load, 64, straggler_within(8, 0.0, 50.0)).sum() == 8


def test_min_replicas_and_zero_load():
    cnt = greedy_scale(np.zeros(4), 12, cv_below(0.0), min_replicas=2)
    assert cnt.tolist() == [2, 2, 2, 2]
    assert replica_cv(np.zeros(4), np.ones(4, dtype=np.int64)) == 0.0


def test_dead_band_keeps_previous_counts_inside_the_band_and_rescales_outside():
    load = np.array([100.0, 90.0, 80.0, 70.0])
    scale = lambda w: greedy_scale(w, 16, cv_below(0.05))
    banded = with_dead_band(scale, cv_below(0.3), budget=16)
    near = np.array([1, 1, 1, 1])  # CV of these loads ~0.13: inside 0.3, kept
    assert banded(load, near).tolist() == near.tolist()
    far = np.array([1, 4, 4, 4])  # CV ~0.9: outside, re-scaled
    assert banded(load, far).tolist() == scale(load).tolist()
    assert banded(load, None).tolist() == scale(load).tolist()
    assert banded(load, np.array([5, 5, 5, 5])).tolist() == scale(load).tolist()  # over budget


@pytest.mark.parametrize(
    "call, message",
    [
        (lambda: greedy_scale(np.array([1.0, -2.0]), 4, cv_below(0.1)), "non-negative"),
        (lambda: greedy_scale(np.array([[1.0]]), 4, cv_below(0.1)), r"\[E\]"),
        (lambda: greedy_scale(np.array([1.0, 2.0]), 1, cv_below(0.1)), "budget"),
        (lambda: greedy_scale(np.array([1.0]), 4, cv_below(0.1), min_replicas=0), "min_replicas"),
        (lambda: straggler_within(0), "GPU"),
    ],
)
def test_invalid_inputs_raise_clear_errors(call, message):
    with pytest.raises(ValueError, match=message):
        call()
