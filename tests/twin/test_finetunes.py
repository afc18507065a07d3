"""Fine-tunes of one base on one pool (twin/finetunes.py, twin/shared_keys.py): ESFT-style fine-tunes,
keys held once, the GB·s split as the expert hosts split it (evenly among the claimants, window by
window) and adding up to the pool's, N = 1 as the shared pool's own comparison, a fine-tune that
replaced nothing paying what its base pays, and the wake-up of a fine-tune whose base is warm."""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest

from finetune_fakes import GB, SETTINGS, base_model, finetunes_of, poisson_requests
from moeless.twin.finetunes import (
    SHARED_KEYS,
    FineTune,
    evaluate_finetunes,
    make_finetune,
    replaced_counts,
)
from moeless.twin.shared_keys import EvenSplit, even_shares, wake_seconds
from moeless.twin.shared_pool import PoolSettings, Requests, evaluate_pool


def test_a_finetune_replaces_its_share_per_layer_the_experts_its_task_routes_to_most():
    assert replaced_counts(32, 8, 0.05).tolist().count(1) == 13 and replaced_counts(32, 8, 0.05).max() == 1
    assert replaced_counts(26, 64, 0.15).sum() == 250 and set(replaced_counts(26, 64, 0.15)) == {9, 10}
    base = base_model(layers=3, experts=16)
    a, b = finetunes_of(base, 2, 0.25)
    for ft in (a, b):
        assert ft.replaced.sum(axis=1).tolist() == [4, 4, 4]
        assert np.allclose(np.sort(ft.model.popularity, axis=1), np.sort(base.popularity, axis=1))  # the same skew
        for layer in range(3):  # its task's four most routed experts of each layer
            top = set(np.argsort(-ft.model.popularity[layer])[:4])
            assert set(np.flatnonzero(ft.replaced[layer])) == top
    assert not np.array_equal(a.replaced, b.replaced)  # another task, other experts
    with pytest.raises(ValueError, match="in \\[0, 1\\)"):
        make_finetune(base, "x", base.popularity, 1.0, np.random.default_rng(0))


def test_one_finetune_is_the_shared_pools_own_comparison():
    """N = 1: the three ways are evaluate_pool's for that one model, and shared keys its expert grain
    without family warmth (which also holds the base's experts it replaced, with nobody to use them)."""
    ft = finetunes_of(base_model(), 1, 0.15)
    requests = [poisson_requests(0.02, 900, 1)]
    doc = evaluate_finetunes(ft, requests, replace(SETTINGS, family_warm=False))
    alone = evaluate_pool([ft[0].model], requests, SETTINGS)
    for way in ("dedicated", "whole-model", "expert-grain"):
        assert doc["gpu_s"][way] == alone["gpu_s"][way]
        assert doc["models"][0]["gb_s"][way] == alone["models"][0]["gb_s"][way]
    m, grain = doc["models"][0], alone["models"][0]
    assert doc["gpu_s"][SHARED_KEYS] == doc["gpu_s"]["expert-grain"]
    assert doc["gpu_s_whole_model_own_gpus"] == doc["gpu_s"]["whole-model"]  # one model: its own GPUs either way
    assert m["gb_s"][SHARED_KEYS] == pytest.approx(grain["gb_s"]["expert-grain"], rel=1e-12)
    assert m["wake_s"][SHARED_KEYS] == grain["wake_s"]["expert-grain"] and m["wake_ups"] > 1
    assert m["cold_starts_outside_wakes_shared_keys"] == grain["cold_starts_outside_wakes"] > 0
    assert m["step_p99_s"][SHARED_KEYS] == m["step_p99_s"]["shared-keys-batched"] == grain["step_p99_s"]["expert-grain"]


def test_whole_models_on_gpus_of_their_own_pay_for_the_gpus_packing_shares():
    """Two 9 GB fine-tunes on GPUs of 64 GB: packed, both awake fit one GPU (G = 2 while one computes);
    each on its own G, the same windows take 2 GPUs each."""
    fts = finetunes_of(base_model(), 2, 0.05)
    both = poisson_requests(0.05, 900, 7)
    doc = evaluate_finetunes(fts, [both, both], PoolSettings(**{**SETTINGS.__dict__, "gpu_bytes": 64 * GB}))
    assert doc["gpu_s_whole_model_own_gpus"] > doc["gpu_s"]["whole-model"]
    awake_s = sum((1 - m["idle_fraction"]) * SETTINGS.horizon_s for m in doc["models"])
    assert doc["gpu_s_whole_model_own_gpus"] == pytest.approx(awake_s * 2)


@pytest.mark.parametrize("keep_warm", [0.0, 0.25])
def test_the_gb_s_split_adds_up_to_the_pools(keep_warm):
    settings = PoolSettings(**{**SETTINGS.__dict__, "keep_warm": keep_warm})
    fts = finetunes_of(base_model(), 4, 0.15)
    doc = evaluate_finetunes(fts, [poisson_requests(r, 900, i) for i, r in enumerate((0.005, 0.02, 0.05, 0.2))], settings)
    per_model = [m["gb_s"][SHARED_KEYS] for m in doc["models"]]
    assert sum(per_model) == pytest.approx(doc["gb_s_shared_keys"], rel=1e-9) and min(per_model) > 0
    for m in doc["models"]:
        assert sum(m["gb_s_shared_keys_parts"].values()) == pytest.approx(m["gb_s"][SHARED_KEYS], rel=1e-12)
    assert sum(m["gpu_s"][SHARED_KEYS] for m in doc["models"]) == pytest.approx(doc["gpu_s"][SHARED_KEYS])
    busiest = max(doc["models"], key=lambda m: m["requests"])
    assert busiest["gb_s_shared_keys_parts"]["base"] == max(m["gb_s_shared_keys_parts"]["base"] for m in doc["models"])


def test_a_window_splits_evenly_among_its_claimants_else_the_last_ones():
    """The hosts' rule at the window's grain, 1 GB·s a held window. Key 0, models A B C: A claims it in
    window 0, A and B in 1, B and C in 2, nobody in 3 (B and C claimed it last), evicted in 4, C alone
    in 5, nobody in 6 (C last in this residency; A and B's claims were the last residency's). Key 1: A
    all along, B too in window 2. By tokens or claims per episode the figures differ."""
    split = EvenSplit(3, 2, GB, 1.0)
    A, B, C = np.eye(3, dtype=bool)
    key0 = [A, A | B, B | C, A & B, None, C, A & B]  # A & B: nobody
    for w, who in enumerate(key0):
        held = np.array([who is not None, True])
        claims = np.stack([np.zeros(3, bool) if who is None else who, A | (B if w == 2 else A & B)], axis=1)
        split.window(w, held, claims)
    assert split.gb_s[:, 0].tolist() == pytest.approx([1 + 1 / 2, 1 / 2 + 1 / 2 + 1 / 2, 1 / 2 + 1 / 2 + 1 + 1])
    assert split.gb_s[:, 1].tolist() == pytest.approx([6.5, 0.5, 0.0])
    # A key held that nobody claimed since it was (re)loaded has no payer: refused, not lost.
    with pytest.raises(ValueError, match="no model claimed"):
        split.window(7, np.array([False, True]), np.zeros((3, 2), bool))  # key 0 evicted; key 1 to A, its last
        split.window(8, np.array([True, True]), np.zeros((3, 2), bool))  # key 0 back, unclaimed


def test_the_split_adds_up_to_the_held_gb_s_and_is_even():
    """Random claims over 200 windows, a key held where claimed or held on for a while after: every
    held window's GB·s is paid once, in equal parts by its payers, and nothing unheld is paid."""
    rng = np.random.default_rng(5)
    n, k, gb = 4, 6, 0.25
    split, held = EvenSplit(n, k, gb * GB, 2.0), np.zeros(k, bool)
    held_windows = np.zeros(k)
    for w in range(200):
        claims = rng.random((n, k)) < 0.2
        held = claims.any(axis=0) | (held & (rng.random(k) < 0.5))  # held on unclaimed: to the last claimants
        before = split.gb_s.copy()
        split.window(w, held, claims)
        paid = split.gb_s - before
        assert paid.sum(axis=0) == pytest.approx(held * gb * 2.0)
        for key in np.flatnonzero(claims.any(axis=0)):  # equal parts to the claimants, nothing to others
            assert paid[claims[:, key], key] == pytest.approx(gb * 2.0 / claims[:, key].sum())
            assert not paid[~claims[:, key], key].any()
        held_windows += held
    assert split.gb_s.sum(axis=0) == pytest.approx(held_windows * gb * 2.0)
    assert even_shares(np.array([True, False]), np.array([[True, True], [True, False]]),
                       np.zeros((2, 2), np.int64)).tolist() == [[0.5, 0.0], [0.5, 0.0]]


def test_shared_keys_hold_each_shared_expert_once():
    """Every fine-tune awake all along, every expert routed: the pool holds each base expert once and each
    fine-tune's own ones, where the expert grain holds every fine-tune's whole set."""
    base = base_model(layers=3, experts=8, gpus=1)
    fts = finetunes_of(base, 3, 0.25)
    steady = Requests(np.arange(0.0, 300.0, 1.0), np.full(300, 2000.0), np.full(300, 20.0))
    s = PoolSettings(horizon_s=300, window_s=1, step_s=0.05, idle_delay_s=60, keep_alive_s=400, gpu_bytes=64 * GB)
    doc = evaluate_finetunes(fts, [steady] * 3, s)
    own = sum(int(ft.replaced.sum()) for ft in fts)
    assert own == 18
    used = int((~np.logical_and.reduce([ft.replaced for ft in fts])).sum())  # a base expert all three replaced: unused
    assert 3 * 8 - 3 <= used < 3 * 8
    held = (base.non_expert_bytes + (used + own) * base.expert_bytes) * 300 / 1e9
    assert doc["gb_s_shared_keys"] == pytest.approx(held)
    assert sum(m["gb_s"]["expert-grain"] for m in doc["models"]) == pytest.approx(3 * base.weight_bytes * 300 / 1e9)
    for m in doc["models"]:  # its own experts, all along, are its own
        assert m["gb_s_shared_keys_parts"]["own"] == pytest.approx(6 * base.expert_bytes * 300 / 1e9)


@pytest.mark.parametrize("family_warm", [False, True])
def test_family_warmth_holds_the_base_s_experts_a_sleeping_fine_tune_uses(family_warm):
    """Fine-tunes 0 and 1 awake all along, 2 never called: the base's experts both awake ones replaced
    are used by 2 alone. With family warmth they are held (loaded where 0 or 1 holds its own: the base
    whole for 2's wake), without it not; 2's own experts never are."""
    base = base_model(layers=3, experts=8, gpus=1)
    fts = finetunes_of(base, 3, 0.25)
    steady = Requests(np.arange(0.0, 300.0, 1.0), np.full(300, 2000.0), np.full(300, 20.0))
    none = Requests(np.zeros(0), np.zeros(0), np.zeros(0))
    s = PoolSettings(horizon_s=300, window_s=1, step_s=0.05, idle_delay_s=60, keep_alive_s=400, gpu_bytes=64 * GB,
                     family_warm=family_warm)
    doc = evaluate_finetunes(fts, [steady, steady, none], s)
    r0, r1, r2 = (ft.replaced for ft in fts)
    awake_use = int((~(r0 & r1)).sum())
    for_two = int((r0 & r1 & ~r2).sum())  # the base's experts only the sleeping one uses
    assert for_two > 0
    base_held = awake_use + (for_two if family_warm else 0)
    held = (base.non_expert_bytes + (base_held + int(r0.sum() + r1.sum())) * base.expert_bytes) * 300 / 1e9
    assert doc["gb_s_shared_keys"] == pytest.approx(held)
    per_model = [m["gb_s"][SHARED_KEYS] for m in doc["models"]]
    assert sum(per_model) == pytest.approx(doc["gb_s_shared_keys"]) and per_model[2] == 0.0


def test_a_finetune_that_replaced_nothing_pays_what_its_base_pays():
    base = base_model()
    same = FineTune(base, np.zeros(base.popularity.shape, bool))
    assert not make_finetune(base, "zero", base.popularity, 0.0, np.random.default_rng(0)).replaced.any()
    requests = poisson_requests(0.03, 900, 4)
    doc = evaluate_finetunes([same, same], [requests, requests], SETTINGS)
    a, b = doc["models"]
    assert a["own_experts"] == 0 and a["gb_s_shared_keys_parts"]["own"] == 0.0
    # The same windows awake: the same share of the non-expert weights. Each draws its own routed experts
    # (one generator for all), so their claims on the base's keys, and their bills, agree to that noise.
    assert a["gb_s_shared_keys_parts"]["non-expert"] == b["gb_s_shared_keys_parts"]["non-expert"] > 0
    assert a["gb_s"][SHARED_KEYS] == pytest.approx(b["gb_s"][SHARED_KEYS], rel=0.02)
    alone = evaluate_pool([base], [requests], SETTINGS)["models"][0]
    assert a["gb_s"]["whole-model"] == alone["gb_s"]["whole-model"]
    # The pair holds at most what the base alone holds at any time: no key of their own.
    assert doc["gb_s_shared_keys"] <= alone["gb_s"]["whole-model"] + 1e-9


def test_wake_seconds_golden():
    """The docstring's example; and on one GPU's link a wake set of ten a layer costs no more than
    loading the routed keys layer by layer (a call's loads go first): 2 x (1 + 3) loads."""
    assert wake_seconds(np.array([2, 2]), np.array([1, 1]), np.array([0, 0]), 4, 2, 1.0) == 1.0
    assert wake_seconds(np.array([10, 10]), np.array([3, 3]), np.array([1, 1]), 1, 1, 1.0) == 8.0
    assert wake_seconds(np.array([0, 0]), np.array([0, 0]), np.array([3, 1]), 8, 2, 1.0) == 3.0  # no wake set: G at a time


def test_a_finetune_whose_base_is_warm_loads_its_own_experts_at_once_over_the_pools_gpus():
    """The base, served all along (a request every second), keeps its experts warm; B wakes at 100 s with
    a long prompt: its wake-up loads its own experts (one a layer, where the base's are held) at once,
    spread over the pool's GPUs (G = 2, or the 4 its bytes take on GPUs of 3 GB), and no non-expert
    weights. Layer by layer, G at a time, it would take 4 loads either way."""
    base = base_model(layers=4, experts=8, gpus=2)
    a = FineTune(base, np.zeros(base.popularity.shape, bool))
    b = finetunes_of(base, 1, 0.125)[0]  # one own expert per layer
    keep = Requests(np.arange(0.0, 300.0, 1.0), np.full(300, 2000.0), np.full(300, 10.0))
    late = Requests(np.array([100.0]), np.array([4000.0]), np.array([10.0]))
    for gpu_gb, loads in ((64, 2), (3, 1)):
        s = PoolSettings(horizon_s=300, window_s=1, step_s=0.05, idle_delay_s=30, keep_alive_s=300, gpu_bytes=gpu_gb * GB)
        doc = evaluate_finetunes([a, b], [keep, late], s)
        woken = doc["models"][1]
        assert woken["wake_s"]["shared-keys-base-warm"]["count"] == 1
        assert woken["wake_s"][SHARED_KEYS]["p50"] == pytest.approx(loads * base.expert_load_s)
        assert woken["wake_s"]["whole-model"]["p50"] == base.whole_load_s
        assert woken["wake_s"]["expert-grain"]["p50"] > base.non_expert_load_s  # alone, it loads the non-expert weights


def test_finetunes_of_different_bases_are_refused():
    with pytest.raises(ValueError, match="share its geometry"):
        evaluate_finetunes(finetunes_of(base_model(), 1, 0.1) + finetunes_of(base_model(experts=16), 1, 0.1),
                           [poisson_requests(0.01, 900, 0)] * 2, SETTINGS)
