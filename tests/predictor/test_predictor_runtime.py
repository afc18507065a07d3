"""The prediction runtime: forecasts come from a worker thread (inline for CPU tensors by default);
under the accuracy floor it serves the history fallback and says so in its metrics, and it recovers."""

import threading

import numpy as np
import pytest
import torch

from moeless.predictor.base import Forecast
from moeless.predictor.gate_replica import gate_reuse
from moeless.predictor.history import HistoryPredictor
from moeless.predictor.runtime import PredictionRuntime

L, E, K = 2, 4, 2
UNIFORM = np.array([5.0, 5.0, 5.0, 5.0])


class SwitchablePredictor:
    """A fake primary for the control logic: all tokens on expert 0 (bad), or the uniform load (good)."""

    name = "fake"

    def __init__(self):
        self.good = False
        self.threads: set[str] = set()

    def predict(self, source, distance, hidden, trajectory):
        self.threads.add(threading.current_thread().name)
        return Forecast(UNIFORM.copy() if self.good else np.array([20.0, 0, 0, 0]))

    def observe(self, loads, trajectory):
        pass

    def nbytes(self):
        return 0


def run_iteration(runtime: PredictionRuntime) -> Forecast:
    runtime.begin(0, 1, torch.zeros(10, 8), np.zeros((1, E)))
    served = runtime.forecast(1)
    runtime.report(1, UNIFORM)
    runtime.end_iteration(np.tile([2.0, 6.0, 6.0, 6.0], (L, 1)), np.zeros((L, E)))
    return served


def test_forecasts_match_direct_prediction_and_run_off_the_calling_thread(sliced, sliced_traces):
    primary = gate_reuse(sliced, [(0, 1)])
    trace = sliced_traces.traces[0]
    with PredictionRuntime(primary, HistoryPredictor(L, E, K)) as runtime:
        runtime.begin(0, 1, trace.hidden[0], trace.trajectory[:1].numpy())
        served = runtime.forecast(1)
        assert runtime.report(1, trace.load[1].numpy()) > 0
    direct = primary.predict(0, 1, trace.hidden[0], trace.trajectory[:1].numpy())
    np.testing.assert_array_equal(served.topk, direct.topk)
    fake = SwitchablePredictor()
    with PredictionRuntime(fake, HistoryPredictor(L, E, K), threaded=True) as runtime:
        run_iteration(runtime)
    assert fake.threads and threading.current_thread().name not in fake.threads


def test_cpu_forecasts_run_inline_by_default_and_a_failure_surfaces_at_forecast():
    fake = SwitchablePredictor()
    with PredictionRuntime(fake, HistoryPredictor(L, E, K)) as runtime:
        fake.good = True
        np.testing.assert_allclose(run_iteration(runtime).load, UNIFORM)
    assert fake.threads == {threading.current_thread().name}
    broken = SwitchablePredictor()
    broken.predict = lambda *args: 1 / 0
    with PredictionRuntime(broken, HistoryPredictor(L, E, K)) as runtime:
        runtime.begin(0, 1, torch.zeros(10, 8), np.zeros((1, E)))
        with pytest.raises(ZeroDivisionError):
            runtime.forecast(1)


def test_falls_back_to_history_under_the_floor_and_recovers():
    primary = SwitchablePredictor()
    with PredictionRuntime(primary, HistoryPredictor(L, E, K), floor=0.7, window=4) as runtime:
        run_iteration(runtime)  # accuracy 1 - 0.5 * 1.5 = 0.25: under the floor
        assert runtime.metrics()["moeless_predictor_fallback_active"] == 1.0
        assert runtime.metrics()["moeless_predictor_fallback_switches_total"] == 1.0
        served = run_iteration(runtime)
        np.testing.assert_allclose(served.load, [2, 6, 6, 6])  # history: the last shares times 10 tokens * k
        primary.good = True
        for _ in range(4):  # the window forgets the bad reports
            run_iteration(runtime)
        metrics = runtime.metrics()
        assert metrics["moeless_predictor_fallback_active"] == 0.0
        assert metrics["moeless_predictor_online_load_accuracy"] == pytest.approx(1.0)
        np.testing.assert_allclose(run_iteration(runtime).load, UNIFORM)
        assert runtime.metrics()["moeless_predictor_forecasts_total"] == 7.0


def test_asking_for_a_forecast_never_begun_is_a_clear_error():
    with PredictionRuntime(SwitchablePredictor(), HistoryPredictor(L, E, K)) as runtime:
        with pytest.raises(KeyError, match="no forecast was begun for layer 1"):
            runtime.forecast(1)
        with pytest.raises(KeyError, match="call forecast"):
            runtime.report(1, UNIFORM)


def test_lanes_keep_forwards_in_flight_together_apart(sliced, sliced_traces):
    # Two micro-batches begin the forecast of the same layer before either collects it: each gets
    # the forecast of its own hidden states, and one lane's forecast is not the other's to report.
    primary = gate_reuse(sliced, [(0, 1)])
    hidden = sliced_traces.traces[0].hidden[0]
    a, b = hidden[:3], hidden[3:]
    trajectory = np.zeros((1, E))
    with PredictionRuntime(primary, HistoryPredictor(L, E, K)) as runtime:
        runtime.begin(0, 1, a, trajectory, lane=0)
        runtime.begin(0, 1, b, trajectory, lane=1)
        served_b, served_a = runtime.forecast(1, lane=1), runtime.forecast(1, lane=0)
        with pytest.raises(KeyError, match="no forecast was begun for layer 1 in lane 1"):
            runtime.forecast(1, lane=1)
        runtime.report(1, served_a.load, lane=0)
        with pytest.raises(KeyError, match="no forecast of layer 1 was served in lane 0"):
            runtime.report(1, served_a.load, lane=0)
        runtime.report(1, served_b.load, lane=1)
    np.testing.assert_array_equal(served_a.load, primary.predict(0, 1, a, trajectory).load)
    np.testing.assert_array_equal(served_b.load, primary.predict(0, 1, b, trajectory).load)
    assert served_a.load.sum() == 3 * K and served_b.load.sum() == (hidden.shape[0] - 3) * K
