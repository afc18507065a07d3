"""moeless's homes (placement/home_moves.py): packed on the summed forecasts, moved on schedule
only where the recent forecasts say it pays, behind serving, the old home released."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import pytest

from moeless.placement import home_fits, home_moves
from moeless.placement.cluster import Cluster
from moeless.placement.home_fits import home_time, packed_homes, static_homes, swapped_homes
from moeless.placement.home_moves import HomeMoves, add_moves
from moeless.placement.latency_model import LatencyModel
from moeless.placement.planner import PlannerConfig, get_planner
from moeless.placement.types import LayerPlacement, Placement

MODEL = LatencyModel(alpha=1e-3, beta=0.0, cold_start=1e-3, call_overhead=1e-4)
HOT = np.array([[40.0, 40, 1, 1]])  # experts 0 and 1 hot, both in GPU 0's static block


def test_packed_homes_golden():
    homes = packed_homes(np.array([[10.0, 1, 1, 10, 5, 5, 1, 1]]), 2)
    assert homes.tolist() == [[0, 0, 1, 1, 0, 1, 0, 1]]  # 10 + 1 + 5 + 1 = 17 on each GPU; static EP: 22 and 12


def test_packed_homes_with_experts_not_a_multiple_of_the_gpus():
    homes = packed_homes(np.array([[9.0, 1, 1, 1, 1]]), 2)
    assert set(homes[0].tolist()) == {0, 1} and np.bincount(homes[0]).max() <= 3


def test_swaps_balance_each_sample_where_the_sums_are_balanced_already(monkeypatch):
    """Experts 0 and 2 are hot together, then 1 and 3: on GPUs [0, 1, 0, 1] the sums are even but
    each sample sits on one GPU (the busiest holds all of it). The first best swap (0 with 1: the
    first pair in order among the ties) splits every sample in half; then no swap helps: stop."""
    model = LatencyModel(alpha=1.0, beta=0.0, cold_start=0.0, call_overhead=0.0)
    samples = np.array([[10.0, 0, 10, 0], [0, 10, 0, 10]] * 3)
    assert swapped_homes(samples, np.array([0, 1, 0, 1]), 2, model).tolist() == [1, 0, 0, 1]
    assert swapped_homes(samples, np.array([0, 1, 0, 1]), 2, model, swaps=0).tolist() == [0, 1, 0, 1]
    assert swapped_homes(samples, np.array([0, 0, 1, 1]), 2, model).tolist() == [0, 0, 1, 1]  # balanced: kept
    assert home_time(samples, np.array([1, 0, 0, 1]), 2, model) == 10.0 < home_time(samples, np.array([0, 1, 0, 1]), 2, model)
    monkeypatch.setattr(home_fits, "MAX_PAIRS", 4)  # a large E: only the busiest GPUs' experts swap (GPU 0's first)
    assert swapped_homes(samples, np.array([0, 1, 0, 1]), 2, model).tolist() == [1, 0, 0, 1]


def test_a_swap_that_evens_each_iteration_may_not_slow_the_window():
    """A prefill of 160 tokens and a decode step of 5 on homes [0, 0, 1, 1]. Swapping experts 0 and 2
    evens the shares most (busiest 0.681 -> 0.644 in the mean) but raises the busiest GPU's tokens
    47 -> 56.5 in the mean (the prefill's 90 -> 110); swapping 0 and 3 evens them less (0.650) and
    lowers them (42): that one is made."""
    samples = np.array([[30.0, 60, 50, 20], [0.0, 1, 1, 3]])
    tokens = LatencyModel(alpha=1.0, beta=0.0, cold_start=0.0)
    assert swapped_homes(samples, np.array([0, 0, 1, 1]), 2, tokens, swaps=1).tolist() == [1, 0, 1, 0]
    assert home_time(samples, np.array([1, 0, 1, 0]), 2, tokens) == 42.0 < home_time(samples, np.array([0, 0, 1, 1]), 2, tokens)


def test_home_time_is_the_busiest_gpus_work_averaged_over_samples():
    samples = np.array([[10.0, 0, 5, 5], [0.0, 10, 0, 0]])
    homes = np.array([0, 0, 1, 1])
    # sample 0: GPU 0 10 tokens 1 call = 10.1 ms, GPU 1 10 tokens 2 calls = 10.2 ms; sample 1: 10.1 ms
    assert home_time(samples, homes, 2, MODEL) == pytest.approx((10.2e-3 + 10.1e-3) / 2)


def test_a_layer_moves_on_schedule_and_only_where_the_new_homes_pay():
    """Layer 0's hot experts share a GPU (a move pays); layer 1's are already apart (none does)."""
    moves = HomeMoves(2, 4, 2, first=3, every=1000)
    forecast = np.array([[40.0, 40, 1, 1], [40.0, 1, 40, 1]])
    for _ in range(3):
        moves.learn(forecast)
        assert (moves.plan_call(MODEL) == static_homes(4, 2)).all()
    moves.learn(forecast)
    homes = moves.plan_call(MODEL)  # the fourth call: after 3 of statistics
    assert homes[0, 0] != homes[0, 1] and homes[1].tolist() == [0, 0, 1, 1]
    assert [m[:3] for m in moves.moves] == [(4, 0, 2)] and moves.describe()[0].startswith("layer 0: 2 experts' homes moved at plan 4")
    for _ in range(5):
        moves.learn(forecast * 0 + 1)
        assert (moves.plan_call(MODEL) == homes).all()  # not due again for 1000 calls


def test_in_the_background_a_chance_does_not_hold_the_plan_and_moves_as_in_place(monkeypatch, caplog):
    """The live loop's way (a thread computes the candidate): the due plan returns at once; the first
    plan after the candidate is ready makes the same move the in-place way made at the due plan; a
    candidate that fails loses its chance only."""
    forecast = np.array([[40.0, 40, 1, 1], [40.0, 1, 40, 1]])
    swaps = ThreadPoolExecutor(1)
    in_place, background = HomeMoves(2, 4, 2, first=3, every=1000), HomeMoves(2, 4, 2, 3, 1000, submit=swaps.submit)
    for moves in (in_place, background):
        for _ in range(3):
            moves.learn(forecast)
            moves.plan_call(MODEL)
    in_place.learn(forecast)
    moved = in_place.plan_call(MODEL).copy()
    computed, real = threading.Event(), home_moves.candidate_homes

    def slow(*args):
        assert computed.wait(10.0), "the test never let the candidate finish"
        return real(*args)

    monkeypatch.setattr(home_moves, "candidate_homes", slow)
    background.learn(forecast)
    assert (background.plan_call(MODEL) == static_homes(4, 2)).all() and background.computing  # not held
    assert (background.plan_call(MODEL) == static_homes(4, 2)).all()  # still computing: the homes serve
    computed.set()
    deadline = time.monotonic() + 10.0
    while background.computing and time.monotonic() < deadline:
        time.sleep(0.01)
    assert (background.plan_call(MODEL) == moved).all() and not background.computing
    assert [m[1:] for m in background.moves] == [m[1:] for m in in_place.moves] and background.moves[0][0] == 6

    def broken(*args):
        raise RuntimeError("no candidate")

    monkeypatch.setattr(home_moves, "candidate_homes", broken)
    background.every = 1  # due at every plan from now on (the knob, live)
    background.learn(forecast[::-1])  # layer 0's hot experts now share GPU 0 in the moved homes
    background.plan_call(MODEL)  # due: submitted, it fails
    while background.computing:
        time.sleep(0.01)
    with caplog.at_level("ERROR", logger=home_moves.__name__):
        assert (background.plan_call(MODEL) == moved).all() and len(background.moves) == 1
    assert "candidate judged at plan 8 failed" in caplog.text
    swaps.shutdown(wait=True)


def test_the_schedule_is_checked():
    for first, every in ((0, 10), (1, -1)):
        with pytest.raises(ValueError, match="after >= 1 call, every >= 0"):
            HomeMoves(1, 4, 2, first=first, every=every)


def test_the_knob_at_zero_stops_moves_and_keeps_the_homes_moved():
    """homeMovesEvery 0 from the start: static EP's homes for good; set to 0 live after a move: the
    moved homes stay (no move back), and no later chance comes."""
    cluster, static = Cluster.uniform(2, 8, 1), Placement.static(1, 4, 2)
    config = PlannerConfig(model=MODEL, home_moves_first=1, home_moves_every=1, gb_s_price=1e9)
    never = get_planner("moeless", replace(config, home_moves_every=0))
    for _ in range(4):
        assert never(HOT, cluster, static).layers[0].gpu.tolist() == [0, 0, 1, 1]
    assert never.describe()[0].startswith("homes: static EP's blocks")
    mover = get_planner("moeless", config)
    for _ in range(2):
        moving = mover(HOT, cluster, static).layers[0]
    assert moving.num_replicas == 6  # expert 1 and 2 swap homes: loading
    moved = Placement((LayerPlacement.even(np.array([0, 1, 2, 3]), np.array([0, 1, 0, 1]), 4),), 4, 2)
    mover = replace(mover, config=replace(config, home_moves_every=0))  # as the planning loop applies a live knob
    swapped = np.array([[40.0, 1, 40, 1]])  # hot experts 0 and 2 now share GPU 0: a move would pay
    for _ in range(3):
        mover.learn(swapped)  # what its gates reported
        layer = mover(swapped, cluster, moved).layers[0]
        assert sorted(zip(layer.expert.tolist(), layer.gpu.tolist())) == [(0, 0), (1, 1), (2, 0), (3, 1)]


def test_a_move_happens_behind_serving_and_leaves_no_copy():
    """The move's new home joins the plan with no tokens while the old one serves; once it is
    resident it takes the tokens and the old home leaves the plan (released), though still warm."""
    planner = get_planner("moeless", PlannerConfig(model=MODEL, home_moves_first=2, gb_s_price=1e9))  # no copies
    cluster = Cluster.uniform(2, 8, 1)
    static = Placement.static(1, 4, 2)
    for _ in range(2):
        assert planner(HOT, cluster, static).layers[0].num_replicas == 4
    moving = planner(HOT, cluster, static).layers[0]
    loading = {(e, g) for e, g, s in zip(moving.expert.tolist(), moving.gpu.tolist(), moving.share.tolist()) if s == 0.0}
    movers = sorted(e for e, _ in loading)
    assert movers == [1, 2] and loading == {(1, 1), (2, 0)}  # hot expert 1 swaps places with cold expert 2
    assert moving.num_replicas == 6 and moving.share[np.isin(moving.expert, movers) & (moving.share > 0)].tolist() == [1.0, 1.0]
    both = Placement((LayerPlacement.even(np.array([0, 1, 2, 3, 1, 2]), np.array([0, 0, 1, 1, 1, 0]), 4),), 4, 2)
    for _ in range(2):  # the old homes stay warm (keep-alive) but are no copies to keep
        after = planner(HOT, cluster, both).layers[0]
        assert sorted(zip(after.expert.tolist(), after.gpu.tolist())) == [(0, 0), (1, 1), (2, 0), (3, 1)]
        assert after.share.tolist() == [1.0] * 4


def test_no_moves_keeps_static_homes_and_planners_do_not_share_homes():
    config = PlannerConfig(model=MODEL, home_moves_first=1, gb_s_price=1e9)
    cluster = Cluster.uniform(2, 8, 1)
    static = Placement.static(1, 4, 2)
    still = get_planner("moeless-no-moves", config)
    mover = get_planner("moeless", config)
    for _ in range(3):
        assert sorted(zip(still(HOT, cluster, static).layers[0].expert.tolist(),
                          still(HOT, cluster, static).layers[0].gpu.tolist())) == [(0, 0), (1, 0), (2, 1), (3, 1)]
        moved = mover(HOT, cluster, static)
    assert moved.layers[0].num_replicas == 6  # two new homes loading
    fresh = get_planner("moeless", config)(HOT, cluster, static)
    assert fresh.layers[0].num_replicas == 4  # a new planner starts at static EP's homes


def test_add_moves_adds_the_missing_homes_only_where_all_fit():
    layer = LayerPlacement.even(np.array([0, 1, 2, 3]), np.array([0, 0, 1, 1]), 4)
    homes, serving = np.array([0, 1, 0, 1]), np.array([0, 0, 1, 1])  # experts 1 and 2 swap GPUs
    assert add_moves(layer, serving, serving, np.array([1, 1]), room=2)[0] is layer  # nothing moves
    grown, left, fits = add_moves(layer, homes, serving, np.array([1, 1]), room=2)
    assert fits and left.tolist() == [0, 0]
    assert sorted(zip(grown.expert.tolist(), grown.gpu.tolist(), grown.share.tolist()))[1:4] == [
        (1, 0, 1.0), (1, 1, 0.0), (2, 0, 0.0)]
    for free, room in (([1, 0], 2), ([1, 1], 1)):  # no slot on GPU 1; room for one replica only
        same, left, fits = add_moves(layer, homes, serving, np.array(free), room)
        assert not fits and same is layer and left.tolist() == free


def test_a_move_the_memory_cannot_hold_is_called_off_and_later_layers_keep_their_budget():
    """Two layers, 4 experts on 2 GPUs with 4 slots each: layer 0's move needs 2 more replicas, which
    would leave layer 1 fewer than its 4 experts; the move is called off and both plans hold."""
    planner = get_planner("moeless", PlannerConfig(model=MODEL, home_moves_first=1, gb_s_price=1e9))
    cluster = Cluster.uniform(2, 4, 1)
    static = Placement.static(2, 4, 2)
    load = np.array([[40.0, 40, 1, 1], [1.0, 1, 1, 1]])
    for _ in range(3):
        plan = planner(load, cluster, static)
        assert [lp.num_replicas for lp in plan.layers] == [4, 4]
        assert sorted(zip(plan.layers[0].expert.tolist(), plan.layers[0].gpu.tolist())) == [(0, 0), (1, 0), (2, 1), (3, 1)]
    moved, called_off = planner.describe()
    assert moved.startswith("layer 0: 2 experts' homes moved at plan 2")
    assert called_off == "layer 0: its move called off at plan 2: the new homes do not fit beside the old in its memory"


@pytest.mark.parametrize("name", ["moeless", "moeless-no-moves"])
def test_early_layers_leave_each_gpu_the_later_layers_homes(name):
    """Memory free, 2 layers of 8 experts on 2 GPUs of 9 slots (homes 0-3 on GPU 0, 4-7 on GPU 1).
    Layer 0's hot experts 0-2 want copies on GPU 1; the totals alone (a budget of 18 - 8) let them
    take 2 of its slots, leaving 3 for layer 1's 4 homes there, and layer 1 then loaded expert 7 on
    GPU 0, cold, and waited for it. Each GPU keeps the later layers' homes: one copy, homes kept."""
    planner = get_planner(name, PlannerConfig(model=MODEL, gb_s_price=0.0))
    plan = planner(np.array([[60.0, 60, 60, 1, 1, 1, 1, 1], [1.0] * 8]), Cluster.uniform(2, 9, 1), Placement.static(2, 8, 2))
    assert plan.layers[1].gpu.tolist() == static_homes(8, 2).tolist()
    assert plan.layers[0].num_replicas == 9
    assert np.bincount(np.concatenate([lp.gpu for lp in plan.layers])).tolist() == [8, 9]


def test_adopt_takes_the_homes_the_hosts_hold_golden():
    """An expert held only away from its home gets its home there (of several GPUs, the one with
    fewest homes); one held at home or nowhere keeps it; the old home is left to release."""
    moves = HomeMoves(1, 4, 2, first=10, every=50)
    held = np.zeros((1, 4, 2), bool)
    held[0, 0, 0] = held[0, 3, 1] = True  # at static EP's homes
    held[0, 1, 1] = True  # moved: its home (GPU 0) holds it no more
    held[0, 2, [0, 1]] = True  # held at home and elsewhere: the home stays
    assert moves.adopt(held) == 1
    assert moves.homes.tolist() == [[0, 1, 1, 1]]
    assert moves.released().tolist() == [[0, 1, 0]]
    assert moves.describe()[0] == "homes: 1 experts' homes where the hosts held them (no move paid by 1% after 0 plans)"
    away = HomeMoves(1, 4, 2, first=10, every=50)
    swapped = np.zeros((1, 4, 2), bool)
    swapped[0, [0, 1, 2, 3], [1, 1, 0, 0]] = True  # the two blocks swapped
    assert away.adopt(swapped) == 4 and away.homes.tolist() == [[1, 1, 0, 0]]
    spread = HomeMoves(1, 4, 4, first=10, every=50)
    held = np.zeros((1, 4, 4), bool)
    held[0, 0, 1] = held[0, 1, 1] = held[0, 2, 2] = True
    held[0, 3, [1, 2]] = True  # GPU 1 has two homes by then, GPU 2 one
    assert spread.adopt(held) == 2 and spread.homes.tolist() == [[1, 1, 2, 2]]
    with pytest.raises(ValueError, match=r"resident must be \[L, E, G\]"):
        away.adopt(np.zeros((1, 4, 3), bool))


def test_a_planner_made_over_moved_homes_keeps_them():
    """A restarted loop: the hosts hold the moved layout (experts 1 and 2 swapped); its resident view
    also counts every static home of a live host. Adopted, the new planner plans the moved homes and
    loads nothing; without it, it loads static EP's homes of experts 1 and 2 back."""
    config = PlannerConfig(model=MODEL, home_moves_first=10, gb_s_price=1e9)  # no copies, no move soon
    cluster = Cluster.uniform(2, 8, 1)
    held = np.zeros((1, 4, 2), bool)
    held[0, [0, 1, 2, 3], [0, 1, 0, 1]] = True
    view = Placement((LayerPlacement.even(np.array([0, 1, 1, 2, 2, 3]), np.array([0, 0, 1, 0, 1, 1]), 4),), 4, 2)
    adopted = get_planner("moeless", config)
    adopted.adopt(held)
    fresh = get_planner("moeless", config)
    for _ in range(3):
        kept = adopted(HOT, cluster, view)
        assert sorted(zip(kept.layers[0].expert.tolist(), kept.layers[0].gpu.tolist())) == [(0, 0), (1, 1), (2, 0), (3, 1)]
        assert kept.release.tolist() == [[0, 1, 0], [0, 2, 1]]  # the static homes: nothing resident there to evict
    back = fresh(HOT, cluster, view).layers[0]
    assert sorted(zip(back.expert.tolist(), back.gpu.tolist()))[:3] == [(0, 0), (1, 0), (1, 1)]
    assert adopted.describe()[0] == "homes: 2 experts' homes where the hosts held them (no move paid by 1% after 3 plans)"
    get_planner("static", config).adopt(held)  # a planner without homes ignores it


def test_the_window_is_the_one_whose_candidates_were_faster_on_later_loads_ties_keep_the_current():
    tokens = LatencyModel(alpha=1.0, beta=0.0, cold_start=0.0)
    tried = {64: np.array([[0, 0, 1, 1]]), 256: np.array([[0, 1, 0, 1]])}
    assert home_fits.window_seconds(tried, np.array([[[9.0, 9, 1, 1]]]), 2, tokens) == {64: 18.0, 256: 10.0}
    assert home_fits.chosen_window({64: 18.0, 256: 10.0}, 64) == 256
    assert home_fits.chosen_window({64: 10.0, 256: 10.0}, 256) == 256
    assert home_fits.chosen_window({64: 10.0, 256: 10.0, 1024: 10.0}, 8) == 64


def test_a_steady_mixture_is_fitted_on_the_long_window_and_a_drift_on_the_short():
    """Three mixtures A, B, C in turn: homes fitted on the last 2 iterations (one or two of them) are
    slower on the next ones than homes fitted on the last 8 (all three), so the long window is chosen
    and said; where the mixture changes for good every 10 iterations the short one stays."""
    tokens = LatencyModel(alpha=1.0, beta=0.0, cold_start=0.0)
    a, b, c = np.array([[10.0, 10, 1, 1, 0, 0]]), np.array([[1.0, 0, 10, 10, 0, 1]]), np.array([[0.0, 1, 0, 10, 10, 1]])

    def fitted(seq):
        moves = HomeMoves(1, 6, 3, first=1, every=4, windows=(2, 8))
        for loads in seq:
            moves.learn(loads)
            moves.plan_call(tokens)
        return moves

    steady = fitted([a, b, c] * 12)
    assert steady.window == 8 and [(k, w) for k, w, _ in steady.window_changes] == [(14, 8)]
    assert "homes fitted on the last 8 iterations from plan 14: each window's candidates timed on the iterations after " \
           "them (the layers' seconds, summed, 0.9 x the earlier chances'): 2 iterations' 37027500.0 us, 8 iterations' " \
           "33027500.0 us" in steady.describe()
    drift = fitted([a] * 10 + [b] * 10 + [c] * 10 + [a] * 10)
    assert drift.window == 2 and drift.window_changes == [] and len(drift.moves) >= 3
    with pytest.raises(ValueError, match="windows of >= 1 iteration"):
        HomeMoves(1, 6, 3, first=1, every=4, windows=())
