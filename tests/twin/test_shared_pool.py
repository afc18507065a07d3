"""Several models on one pool, three ways (twin/shared_pool.py): the module's golden example and
properties that hold for any arrivals."""

from __future__ import annotations

import numpy as np
import pytest

from moeless.twin.shared_pool import (
    ModelTimeline,
    PoolModel,
    PoolSettings,
    Requests,
    awake_windows,
    evaluate_pool,
    step_time_p99,
    warm_mask,
    window_tokens,
)

GB = 10**9


def _model(name: str = "tiny", layers: int = 2, experts: int = 2, gpus: int = 1, top_k: int = 1) -> PoolModel:
    return PoolModel(name, top_k, GB, GB, gpus, 1.0, 1.0, 1e-3, 1e-4, np.full((layers, experts), 1.0 / experts))


def test_the_golden_example():
    """The module docstring's example: awake in windows 0-4 of 10, so each shared pool holds half the GPU-seconds."""
    s = PoolSettings(horizon_s=10, window_s=1, step_s=1, idle_delay_s=3, keep_alive_s=60, gpu_bytes=8 * GB)
    run = evaluate_pool([_model()], [Requests(np.array([0.0]), np.array([4.0]), np.array([2.0]))], s)
    assert run["gpu_s"] == {"dedicated": 10.0, "whole-model": 5.0, "expert-grain": 5.0}
    model = run["models"][0]
    assert model["idle_fraction"] == 0.5 and model["wake_ups"] == 1 and model["requests"] == 1
    assert model["wake_s"]["whole-model"]["p50"] == 5.0  # 1 s of non-expert weights + 4 experts of 1 s on one GPU
    assert model["gb_s"]["dedicated"] == 50.0 and model["gb_s"]["whole-model"] == 25.0


def test_tokens_go_to_the_windows_a_request_runs_in_and_a_model_sleeps_after_its_delay():
    s = PoolSettings(horizon_s=10, window_s=1, step_s=0.5)
    tokens, busy = window_tokens(Requests(np.array([1.5]), np.array([10.0]), np.array([4.0])), s)
    assert tokens.sum() == pytest.approx(14.0) and tokens[1] == pytest.approx(10 + 4 / 3)  # decodes over windows 1-3
    assert busy.tolist() == [False, True, True, True] + [False] * 6
    assert awake_windows(busy, 2).tolist() == [False, True, True, True, True, True] + [False] * 4


def test_a_busy_pool_is_never_cheaper_than_its_memory_and_never_dearer_than_dedicated_pools():
    rng = np.random.default_rng(3)
    models = [_model("a", 4, 8, 2, 2), _model("b", 3, 16, 3, 1)]
    s = PoolSettings(horizon_s=600, window_s=1, step_s=0.05, idle_delay_s=30, keep_alive_s=30, gpu_bytes=20 * GB, seed=1)
    requests = []
    for rate in (0.05, 0.5):
        arrival = np.sort(rng.uniform(0, 600, rng.poisson(rate * 600)))
        requests.append(Requests(arrival, rng.integers(1, 300, len(arrival)).astype(float),
                                 rng.integers(1, 200, len(arrival)).astype(float)))
    run = evaluate_pool(models, requests, s)
    gpu_s = run["gpu_s"]
    assert gpu_s["expert-grain"] <= gpu_s["whole-model"] + 1e-9 <= gpu_s["dedicated"] + 1e-9
    for m in run["models"]:
        # an expert-grain model holds at most what a whole model holds, and only while awake
        assert m["gb_s"]["expert-grain"] <= m["gb_s"]["whole-model"] + 1e-6
        assert m["gb_s"]["whole-model"] == pytest.approx(m["gb_s"]["dedicated"] * (1 - m["idle_fraction"]))
        assert m["wake_s"]["expert-grain"]["count"] == m["wake_ups"]
        # stalls only slow steps down; the other ways have none
        assert m["step_p99_s"]["expert-grain"] >= m["step_p99_s"]["dedicated"] == m["step_p99_s"]["whole-model"] > 0


def test_calls_meeting_on_a_shared_pools_gpus_slow_its_steps_never_below_alone():
    """One model: its calls meet nobody's, so each shared pool's figure is its own. Two models with the
    same requests on GPUs of 64 GB: both fit one GPU (G = 1), so while both compute each step takes both
    models' work on it, twice its own, and stalls still add in the expert grain."""
    s = PoolSettings(horizon_s=300, window_s=1, step_s=0.05, idle_delay_s=30, keep_alive_s=30, gpu_bytes=64 * GB, seed=1)
    rng = np.random.default_rng(5)
    arrival = np.sort(rng.uniform(0, 300, 40))
    requests = Requests(arrival, rng.integers(50, 300, 40).astype(float), rng.integers(20, 200, 40).astype(float))
    one = evaluate_pool([_model("a", 4, 4)], [requests], s)["models"][0]["step_p99_s"]
    assert one["whole-model-shared-gpus"] == one["whole-model"] and one["expert-grain-shared-gpus"] == one["expert-grain"]
    two = evaluate_pool([_model("a", 4, 4), _model("b", 4, 4)], [requests, requests], s)
    for m in two["models"]:
        p99 = m["step_p99_s"]
        assert p99["whole-model-shared-gpus"] == pytest.approx(2 * p99["whole-model"])
        assert p99["expert-grain-shared-gpus"] >= p99["expert-grain"] and p99["expert-grain-shared-gpus"] >= 2 * p99["dedicated"]


def test_p99_step_time_outside_wake_ups_counts_each_cold_start_as_a_stalled_step():
    """3 busy windows of 100 steps on 2 GPUs, window 0 a wake-up (left out): 100 steps of 0.01 s and 100 of
    0.02 s; 3 cold starts of 1 s in window 2 are 1.5% of the steps, so they set the expert-grain p99; one
    (0.5%) would not."""
    s = PoolSettings(horizon_s=3, window_s=1, step_s=0.01)
    ones = np.ones(3)

    def line(cold):
        return ModelTimeline(ones, ones > 0, ones > 0, np.zeros(3, np.int64), np.asarray(cold), np.array([0]),
                             ones[:1], ones[:1], np.array([9.0, 2.0, 4.0]))

    model = _model(gpus=2)  # expert_load_s 1.0
    assert step_time_p99(model, line([0, 0, 3]), s) == pytest.approx(
        {"dedicated": 0.02, "whole-model": 0.02, "expert-grain": 1.02})
    assert step_time_p99(model, line([0, 0, 1]), s)["expert-grain"] == pytest.approx(0.02)
    assert step_time_p99(model, line([50, 0, 0]), s)["expert-grain"] == pytest.approx(0.02)  # in the wake-up


def test_a_keep_warm_set_shortens_wake_ups_and_is_paid_for_while_asleep():
    assert warm_mask(np.array([[0.1, 0.5, 0.2, 0.2], [0.4, 0.3, 0.2, 0.1]]), 0.5).tolist() == [
        [False, True, True, False], [True, True, False, False]]  # ties: the lower index
    rng = np.random.default_rng(5)
    model = _model("a", 4, 8, 2, 2)
    arrival = np.sort(rng.uniform(0, 1200, 12))
    requests = [Requests(arrival, np.full(12, 400.0), np.full(12, 50.0))]
    runs = {share: evaluate_pool([model], requests, PoolSettings(horizon_s=1200, window_s=1, step_s=0.05,
                                                                 idle_delay_s=30, keep_alive_s=30, gpu_bytes=40 * GB,
                                                                 keep_warm=share))["models"][0]
            for share in (0.0, 0.5, 1.0)}
    waits = {share: run["wake_s"]["expert-grain"]["p50"] for share, run in runs.items()}
    assert waits[1.0] == 1.0 < waits[0.5] < waits[0.0]  # all warm: only the non-expert weights load
    gb_s = {share: run["gb_s"]["expert-grain"] for share, run in runs.items()}
    assert gb_s[0.0] < gb_s[0.5] < gb_s[1.0]  # the warm experts are held (and billed) while asleep
    assert runs[0.0]["gb_s"]["whole-model"] == runs[1.0]["gb_s"]["whole-model"]  # the other ways unchanged


def test_mismatched_inputs_are_refused():
    with pytest.raises(ValueError, match="one request list per model"):
        evaluate_pool([_model()], [], PoolSettings())
