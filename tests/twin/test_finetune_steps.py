"""The one engine's step on a pool of fine-tunes (twin/finetunes.py): the pool sized for the batched
step's SLO (step_floor, held_for, seen_late), the added GPUs' copies and a late scaler (added_gpus,
scaled_p99), and newcomers that wait for a scale-up (newcomer_windows, admission_waits)."""

from __future__ import annotations

from dataclasses import replace
from types import SimpleNamespace

import numpy as np
import pytest

from finetune_fakes import GB, SETTINGS, base_model, finetunes_of, poisson_requests
from moeless.twin.finetunes import (
    GATED,
    SHARED_KEYS,
    SIZED,
    added_gpus,
    admission_waits,
    evaluate_finetunes,
    gated_wakes,
    held_for,
    newcomer_windows,
    scaled_p99,
    seen_late,
    step_floor,
)
from moeless.twin.shared_keys import shared_keys_pass
from moeless.twin.shared_pool import PoolSettings, timelines


def test_a_batched_step_carries_every_busy_finetunes_tokens_and_a_pool_sized_for_it_holds_more_gpus():
    """Two fine-tunes with the same requests: the one engine's step carries both's tokens. By bytes the
    pool holds G GPUs of 64 GB while they compute (everything fits), and the step takes both's work on
    them; sized for the step it holds more in those windows, and neither's step is longer than alone."""
    fts = finetunes_of(base_model(), 2, 0.05)
    both = poisson_requests(0.05, 900, 7)
    doc = evaluate_finetunes(fts, [both, both], PoolSettings(**{**SETTINGS.__dict__, "gpu_bytes": 64 * GB}))
    assert doc["gpu_s_sized_for_step"] > doc["gpu_s"][SHARED_KEYS]
    alone = max(m["step_p99_s"][SHARED_KEYS] for m in doc["models"])
    for m in doc["models"]:
        assert m["step_p99_s"]["shared-keys-batched"] > m["step_p99_s"][SHARED_KEYS] >= m["step_p99_s"]["dedicated"]
        assert m["step_p99_s"]["shared-keys-batched-sized"] <= alone * 1.01


def test_the_step_floor_is_at_most_g_for_one_finetune_and_grows_with_the_batched_work():
    """One fine-tune's SLO is its dedicated p99 step: its own steps need at most its G GPUs (exactly G
    in its slowest windows), twice the work up to twice the GPUs."""
    ft = finetunes_of(base_model(gpus=2), 1, 0.1)
    s = PoolSettings(**{**SETTINGS.__dict__, "gpu_bytes": 64 * GB})
    lines = timelines([ft[0].model], [poisson_requests(0.05, 900, 3)], s)
    sk = shared_keys_pass([ft[0].model], ft[0].replaced[None], lines, s)
    slo = np.array([evaluate_finetunes(ft, [poisson_requests(0.05, 900, 3)], s)["models"][0]["step_p99_s"]["dedicated"]])
    floor = step_floor(sk.batched_step_s, lines, slo, 2, s)
    busy = lines[0].busy
    assert floor[busy].max() == 2.0 and floor[busy].min() >= 1.0 and not floor[~busy].any()
    assert step_floor(2 * sk.batched_step_s, lines, slo, 2, s)[busy].max() == 4.0


def test_the_step_floor_meets_every_busy_finetunes_slo_or_its_step_alone():
    """Golden, G = 1, one step a window: batched steps of 3, 3, 3, 2 and 0 GPU-seconds; fine-tune 0 (SLO
    2 s, alone 1 s a step) busy in windows 0-1 and 3, fine-tune 1 (SLO 1 s, alone 1.5 s in window 2) in
    windows 1-2, fine-tune 2 (no SLO: never stepped outside a wake-up; alone 2 s) in window 3."""
    busy = ([1, 1, 0, 1, 0], [0, 1, 1, 0, 0], [0, 0, 0, 1, 0])
    alone = ([1, 1, 0, 1, 0], [0, 1, 1.5, 0, 0], [0, 0, 0, 2, 0])
    lines = [SimpleNamespace(busy=np.array(b, bool), compute_s=np.array(a, float)) for b, a in zip(busy, alone)]
    floor = step_floor(np.array([3.0, 3.0, 3.0, 2.0, 0.0]), lines, np.array([2.0, 1.0, 0.0]), 1,
                       PoolSettings(window_s=1.0, step_s=1.0))
    assert floor.tolist() == [2.0, 3.0, 2.0, 1.0, 0.0]


def test_gpus_added_for_a_step_load_their_share_before_its_steps_spread_over_them():
    """Golden: 1, 3, 3, 2 GPUs holding 6 keys of 0.1 s each; the window growing to 3 GPUs loads 2 keys
    a GPU (0.2 s: 2 of its 10 steps of 0.1 s run on the 1 GPU before), none other. Steps of 6 GPU
    seconds take 6 s on 1 GPU, 2 s on 3: over that window and the next (20 steps) the p99 is 6 s; a load
    of 0.05 s slows 1 step; a cold start stalls 1 step by its 0.5 s."""
    ready = added_gpus(np.array([1.0, 3.0, 3.0, 2.0]), np.full(4, 6.0), 0.1)
    assert ready.tolist() == [[1.0, 0.0], [1.0, pytest.approx(0.2)], [3.0, 0.0], [2.0, 0.0]]
    # of each 0.1 s, an ask's 0.05 s: one ask a key is the same; one ask for 4 keys pays it once for the 2
    assert added_gpus(np.array([1.0, 3.0]), np.full(2, 6.0), 0.1, 0.0, 0.05, 1)[1, 1] == pytest.approx(0.2)
    assert added_gpus(np.array([1.0, 3.0]), np.full(2, 6.0), 0.1, 0.0, 0.05, 4)[1, 1] == pytest.approx(0.15)
    assert added_gpus(np.array([1.0, 4.0]), np.full(2, 2.0), 0.1, 0.0, 0.05, 4)[1, 1] == pytest.approx(0.05)  # half a key
    p99 = scaled_p99(np.array([6.0, 6.0]), np.array([3.0, 3.0]), ready[1:3], np.zeros(2), 10, 0.1, 0.5)
    assert p99 == pytest.approx(6.0)
    assert scaled_p99(np.array([6.0]), np.array([3.0]), np.array([[1.0, 0.05]]), np.zeros(1), 10, 0.1, 0.5) == 6.0
    assert scaled_p99(np.array([6.0]), np.array([3.0]), np.array([[3.0, 0.0]]), np.array([1]), 10, 0.1, 0.5) == 2.5
    base = base_model()  # a move copies from a peer GPU where the pool has the link's time, else loads from host
    assert base.expert_move_s == base.expert_load_s and replace(base, expert_peer_s=1e-3).expert_move_s == 1e-3


def test_newcomers_waiting_for_a_scale_up_leave_the_steps_before_it_what_those_gpus_were_sized_for():
    """Golden (the example above, gated): the window growing from 1 GPU to 3 keeps its first 2 steps on the
    1 GPU, but they carry the window before's step (2 GPU seconds: 2 s), not its own 6: the p99 over the
    two windows is 2 s, not 6. A request arriving in that window waits its 0.2 s (whenever in it it
    arrives: a bound), one arriving elsewhere nothing."""
    ready = added_gpus(np.array([1.0, 3.0, 3.0]), np.full(3, 6.0), 0.1)
    p99 = scaled_p99(np.array([6.0, 6.0]), np.array([3.0, 3.0]), ready[1:3], np.zeros(2), 10, 0.1, 0.5,
                     slow_step_s=np.array([2.0, 6.0]))
    assert p99 == pytest.approx(2.0)
    waits = admission_waits(np.array([0.1, 1.05, 1.9, 2.5]), ready, 1.0)
    assert waits.tolist() == [0.0, pytest.approx(0.2), pytest.approx(0.2), 0.0]
    # a fine-tune busy from that window on is a newcomer there: no step of its own before the 0.2 s, 8 after
    gated, steps = newcomer_windows(ready, np.array([False, True, True]), 10, 0.1)
    assert gated.tolist() == [[1.0, 0.0], [1.0, 0.0], [3.0, 0.0]] and steps.tolist() == [10, 8, 10]
    assert scaled_p99(np.array([6.0, 6.0]), np.array([3.0, 3.0]), gated[1:], np.zeros(2), steps[1:], 0.1, 0.5,
                      slow_step_s=np.array([20.0, 6.0])) == pytest.approx(2.0)  # the incumbents' big step is not its
    incumbent, steps = newcomer_windows(ready, np.array([True, True, True]), 10, 0.1)
    assert incumbent.tolist() == ready.tolist() and steps.tolist() == [10, 10, 10]


def test_gated_admission_is_never_slower_per_step_and_prices_its_waits():
    fts = finetunes_of(base_model(), 2, 0.05)
    both = poisson_requests(0.05, 900, 7)
    doc = evaluate_finetunes(fts, [both, both], PoolSettings(**{**SETTINGS.__dict__, "gpu_bytes": 64 * GB}))
    for m in doc["models"]:
        assert m["step_p99_s"][GATED] <= m["step_p99_s"][SIZED]
        waits = m["scale_up_waits"]
        assert 0 < waits["waited"] < 1 and waits["count"] == round(waits["waited"] * len(both.arrival))
        assert 0 < waits["p50"] <= waits["p99"]
        warm, gated = m["wake_s"]["shared-keys-base-warm"], m["wake_s"]["shared-keys-base-warm-gated"]
        assert gated["count"] == warm["count"] and (gated["p99"] or 0) >= (warm["p99"] or 0)  # a wait never shortens a wake


def test_a_wake_up_in_a_growing_window_takes_the_longer_of_its_loads_and_the_scale_up():
    ready = np.array([[1.0, 0.0], [1.0, 0.3], [2.0, 0.0]])  # window 1 grows: its added GPUs ready after 0.3 s
    wakes = np.array([[0, 0.1, 1.0], [1, 0.1, 1.0], [1, 0.5, 1.0], [2, 0.2, 1.0]])  # window, seconds, base warm
    assert gated_wakes(wakes, ready).tolist() == [0.1, 0.3, 0.5, 0.2]
    assert gated_wakes(np.zeros((0, 3)), ready).tolist() == []


def test_a_gpu_added_for_the_step_is_held_its_delay_after_the_last_window_needing_it():
    assert held_for(np.array([1.0, 3.0, 1.0, 1.0, 2.0, 0.0, 0.0]), 2).tolist() == [1.0, 3.0, 3.0, 3.0, 2.0, 2.0, 2.0]
    assert held_for(np.array([1.0, 3.0, 1.0]), 0).tolist() == [1.0, 3.0, 1.0]


def test_a_scaler_late_within_a_window_keeps_its_gpus_but_runs_more_of_its_steps_on_those_before():
    """Golden: 0.15 s late, the window growing to 3 GPUs waits 0.15 s + its 0.2 s of copies (4 of its
    10 steps of 0.1 s on the 1 GPU before, against 2 in time). In the twin: a lag under one window holds
    the same GPUs as none and its batched p99 is no shorter; a lag of a whole window holds them a window later."""
    ready = added_gpus(np.array([1.0, 3.0, 3.0]), np.full(3, 6.0), 0.1, late_s=0.15)
    assert ready.tolist() == [[1.0, 0.0], [1.0, pytest.approx(0.35)], [3.0, 0.0]]
    fts = finetunes_of(base_model(), 2, 0.05)
    both = poisson_requests(0.05, 900, 7)
    docs = {lag: evaluate_finetunes(fts, [both, both], PoolSettings(**{**SETTINGS.__dict__, "gpu_bytes": 64 * GB,
                                                                       "step_lag_s": lag}))
            for lag in (0.0, SETTINGS.window_s / 2, SETTINGS.window_s)}
    early, within, late = docs.values()
    assert within["gpu_s_sized_for_step"] == early["gpu_s_sized_for_step"] != late["gpu_s_sized_for_step"]
    for a, b in zip(early["models"], within["models"]):
        assert b["step_p99_s"]["shared-keys-batched-sized"] >= a["step_p99_s"]["shared-keys-batched-sized"]
        assert b["step_p99_s"]["shared-keys-batched"] == a["step_p99_s"]["shared-keys-batched"]


def test_a_scaler_a_window_late_holds_each_windows_need_in_the_next():
    assert seen_late(np.array([1.0, 3.0, 2.0]), 1).tolist() == [0.0, 1.0, 3.0]
    assert seen_late(np.array([1.0, 3.0]), 0).tolist() == [1.0, 3.0] and seen_late(np.array([1.0]), 2).tolist() == [0.0]


def test_the_keys_a_scale_up_copies_are_those_the_windows_calls_route_to():
    """One fine-tune: each awake window's routed keys are the experts its window's tokens hit (its own
    and the base's alike); two: at most the keys held, some where either is busy, none where neither
    is awake."""
    ft = finetunes_of(base_model(), 2, 0.25)
    s = PoolSettings(**{**SETTINGS.__dict__, "gpu_bytes": 64 * GB})
    requests = [poisson_requests(0.05, 900, 3), poisson_requests(0.05, 900, 4)]
    lines = timelines([ft[0].model], requests[:1], s)
    sk = shared_keys_pass([ft[0].model], ft[0].replaced[None], lines, s)
    awake = lines[0].awake
    assert awake.any() and sk.routed_keys[awake].tolist() == [float(h.sum()) for h in lines[0].hits]
    assert not sk.routed_keys[~awake].any()
    both = timelines([f.model for f in ft], requests, s)
    sk = shared_keys_pass([f.model for f in ft], np.stack([f.replaced for f in ft]), both, s)
    base = ft[0].model
    awake = np.any([line.awake for line in both], axis=0)
    held_keys = (sk.held_bytes - awake * float(base.non_expert_bytes)) / base.expert_bytes
    busy = np.any([line.busy for line in both], axis=0)
    assert (sk.routed_keys <= held_keys + 1e-9).all() and (sk.routed_keys[busy] > 0).all()
    assert not sk.routed_keys[~awake].any() and (sk.routed_keys < held_keys - 0.5).any()  # some held keys not routed
