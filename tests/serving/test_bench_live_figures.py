"""`moeless bench live`'s arithmetic on made-up loop figures: the critical path and its parts, the
hosts' meters over the run, the latency model's prediction (calibrated, refitted online, fitted
in hindsight), ratios."""

import numpy as np
import pytest

from moeless.controller.planning.window import IterationReport, LayerFigures, LiveStats
from moeless.bench.live_figures import add_in_run_model, config_figures, fit_in_run, ratios

L = 2
FIT = {"host_s": 1e-5, "c0": 1e-4, "beta": 1e-7}  # hardware/host_profile.fit_costs's keys


def metrics(compute_s, model_s, host_tokens=10.0, cold=0, online_s=None):
    """The loop's metrics() after one prefill and one decode iteration with these per-layer figures
    (`cold` cold starts in the prefill's first layer; online_s: the refitted model's compute)."""
    stats = LiveStats(L)
    for phase in ("prefill", "decode"):
        figures = LayerFigures(wall_s=np.full(L, 1e-3), compute_s=np.full(L, compute_s), host_tokens=np.full(L, host_tokens),
                               host_calls=np.full(L, 2.0),
                               cold_starts=np.array([cold if phase == "prefill" else 0.0, 0.0]), model_s=np.full(L, model_s),
                               imbalance=np.ones(L), cv=np.zeros(L))
        stats.add(IterationReport("r", 0.0, 0.01, phase, 4, np.ones((L, 4)), None, float("nan"), 1e-4, figures),
                  None if online_s is None else np.full(L, online_s))
    return {"stats": stats.as_dict(), "resident_replicas": 8, "passes": 3, "plans": 2, "publishes": 1, "loads_sent": 0,
            "errors": 0, "plan_s": {"sum": 0.02}, "latency_fit": {"a": 1.0, "b_s": 0.0, "calls": 4}}


def meters(gb_s=0.0, exposed=0.0, cold=0):
    return {"gb_s": gb_s, "loads": cold, "cold_starts": cold, "cold_exposed_s": exposed, "cold_hidden_s": 0.0,
            "evictions": 0}


def test_critical_path_is_compute_plus_transfer_plus_exposed_waits():
    before, after = [meters(), meters()], [meters(1.0), meters(0.5, exposed=4e-4, cold=1)]
    out = config_figures(metrics(3e-4, 2e-4, cold=1), before, after, FIT)
    assert out["expert_gb_s"] == pytest.approx(1.5) and out["hosts_delta"]["cold_starts"] == 1
    p = out["phases"]["prefill"]
    transfer = FIT["c0"] + 2 * FIT["beta"] * 10
    # Exposed waits: all in prefill (its calls had the cold start), spread over its 2 layer calls.
    assert p["critical_path_s"] == pytest.approx(3e-4 + transfer + 4e-4 / 2)
    assert p["model_s"] == pytest.approx(2e-4 + FIT["host_s"] + transfer + 4e-4 / 2)
    assert out["phases"]["decode"]["exposed_wait_s"] == 0.0
    assert out["phases"]["decode"]["critical_path_s"] == pytest.approx(3e-4 + transfer)
    # Without a refit the online prediction is the calibrated model's compute (no host call cost).
    assert p["model_online_s"] == pytest.approx(2e-4 + transfer + 4e-4 / 2)


def test_the_online_model_is_read_from_the_loops_causal_predictions():
    out = config_figures(metrics(3e-4, 2e-4, online_s=2.7e-4), [meters()], [meters()], FIT)
    d, transfer = out["phases"]["decode"], FIT["c0"] + 2 * FIT["beta"] * 10
    assert d["model_online_s"] == pytest.approx(2.7e-4 + transfer)
    assert d["model_online_error"] == pytest.approx((2.7e-4 + transfer) / (3e-4 + transfer) - 1.0)
    assert d["model_error"] < d["model_online_error"] < 0  # closer than the idle calibration


def test_in_run_model_fitted_on_static_predicts_the_others():
    fit = {**FIT, "host_s": 0.0}
    static = {"phases": config_figures(metrics(5e-4, 2e-4), [meters()], [meters()], fit)["phases"]}
    other = {"phases": config_figures(metrics(4e-4, 1.5e-4), [meters()], [meters()], fit)["phases"]}
    a, b = fit_in_run(static["phases"])
    # One shape on both phases: any (a, b) with a x 2e-4 + b = 5e-4 fits; the prediction stays a line.
    assert a * 2e-4 + b == pytest.approx(5e-4)
    add_in_run_model({"static": static, "other": other}, a, b)
    assert static["phases"]["decode"]["model_in_run_error"] == pytest.approx(0.0, abs=1e-9)
    predicted = other["phases"]["decode"]["model_in_run_s"]
    assert predicted == pytest.approx(a * 1.5e-4 + b + FIT["c0"] + 2 * FIT["beta"] * 10)
    assert ratios({"static": static, "other": other})["other"]["prefill"] < 1.0


def test_bracketed_ratios_divide_by_the_mean_of_both_static_runs():
    def run(compute_s):
        return {"phases": config_figures(metrics(compute_s, 1e-4), [meters()], [meters()], FIT)["phases"]}

    results = {"static": run(3e-4), "other": run(3e-4), "static-again": run(5e-4)}
    cp = {n: r["phases"]["decode"]["critical_path_s"] for n, r in results.items()}
    bracketed = ratios(results, ("static", "static-again"))
    assert bracketed["other"]["decode"] == pytest.approx(cp["other"] / ((cp["static"] + cp["static-again"]) / 2))
    assert bracketed["other"]["decode"] < ratios(results)["other"]["decode"] == pytest.approx(1.0)
    assert ratios({"static": results["static"]}, ("static", "static-again")) == {}


def test_mirrored_runs_pool_per_configuration_so_a_linear_drift_cancels():
    def run(compute_s):
        return {"phases": config_figures(metrics(compute_s, 1e-4), [meters()], [meters()], FIT)["phases"]}

    # static, other, other~2, static~2 with the machine 10% slower at each step: same placement,
    # drifting machine; pooled, the two configurations are equal.
    results = {"static": run(3e-4), "other": run(3.3e-4), "other~2": run(3.6e-4), "static~2": run(3.9e-4)}
    pooled = ratios(results)
    assert set(pooled) == {"static", "other"}
    assert pooled["other"]["decode"] == pytest.approx(1.0) and pooled["other"]["prefill"] == pytest.approx(1.0)
