"""The latency model's online refit (controller/planning/cost_fit.py): pure arithmetic on made-up calls."""

import numpy as np
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from moeless.controller.planning.cost_fit import OnlineCostFit, fit_scale, solve_scale
from moeless.placement.profile import CostProfile

US = 1e-6


def test_golden_example_from_the_docstring():
    a, b = fit_scale(np.array([1 * US, 2 * US]), np.ones(2), np.array([3 * US, 5 * US]))
    assert a == pytest.approx(2.0) and b == pytest.approx(1 * US)


def test_a_pair_without_physical_meaning_falls_back_to_a_scale_and_nothing_to_the_identity():
    # y = 2 m - 1 us has b < 0: a scale alone, least squares through the origin.
    m, y = np.array([1.0, 2.0, 3.0]) * US, np.array([1.0, 3.0, 5.0]) * US
    a, b = fit_scale(m, np.ones(3), y)
    assert b == 0.0 and a == pytest.approx((m @ y) / (m @ m))
    assert solve_scale(0.0, 0.0, 1.0, 0.0, 1.0) is None  # no model time: no scale fits
    assert fit_scale(np.zeros(2), np.ones(2), np.ones(2) * US) == (1.0, 0.0)


@settings(max_examples=60, deadline=None)
@given(a=st.floats(0.2, 5.0), b=st.floats(0.0, 50.0), models=st.lists(st.floats(1.0, 500.0), min_size=2, max_size=20,
                                                                        unique=True))
def test_noiseless_calls_give_back_their_line(a, b, models):
    # A line is given back from points spread along it: model times 2.0 and 2.00001 us alone are
    # ill-conditioned (the fit then moves in the sixth digit), which no host's calls are.
    assume(max(models) - min(models) > 1.0)
    m = np.array(models) * US
    fitted = fit_scale(m, np.ones(len(m)), a * m + b * US)
    assert fitted[0] == pytest.approx(a, rel=1e-6) and fitted[1] == pytest.approx(b * US, rel=1e-6, abs=1e-12)


def calls(fit, t, a, b=0.0, layers=30):
    model = np.linspace(10, 300, layers) * US
    fit.add(t, model, np.ones(layers, dtype=bool), a * model + b)


def test_the_prior_holds_until_enough_calls_then_the_fit_and_predictions_are_causal():
    fit = OnlineCostFit(host_call_s=5 * US, min_calls=60)
    model, ran = np.array([100 * US, 0.0]), np.array([True, False])
    assert fit.coefficients == (1.0, 5 * US)
    assert fit.predict(model, ran).tolist() == pytest.approx([105 * US, 0.0])  # no call, no time
    calls(fit, 0.0, 2.0, 3 * US)
    assert fit.coefficients == (1.0, 5 * US) and fit.calls == 30  # 30 < 60 calls
    calls(fit, 0.1, 2.0, 3 * US)
    a, b = fit.coefficients
    assert a == pytest.approx(2.0) and b == pytest.approx(3 * US)
    assert fit.as_dict()["fitted"]


def test_old_calls_are_forgotten_as_the_machine_changes():
    fit = OnlineCostFit(half_life_s=10.0, min_calls=1)
    for t in range(10):
        calls(fit, float(t), 1.0)
    for t in range(100, 110):  # 10 half-lives later the machine is 3x slower
        calls(fit, float(t), 3.0)
    assert fit.coefficients[0] == pytest.approx(3.0, rel=2e-3)
    calls(fit, 50.0, 1.0)  # a late report from long ago counts for little
    assert fit.coefficients[0] == pytest.approx(3.0, rel=0.05)


def test_rows_without_calls_change_nothing():
    fit = OnlineCostFit(min_calls=1)
    fit.add(0.0, np.ones(3), np.zeros(3, dtype=bool), np.ones(3))
    assert fit.calls == 0 and fit.coefficients == (1.0, 0.0)
    with pytest.raises(ValueError, match="half_life_s"):
        OnlineCostFit(half_life_s=0.0)


def test_the_planners_profile_scales_compute_and_keeps_the_rest():
    profile = CostProfile(alpha=2e-6, beta=1e-7, call_overhead=1e-5, load_s={"disk": 1e-3, "host": 1e-5},
                          expert_bytes=100, non_expert_bytes=1000, relevel_s=2e-5, source="test")
    fit = OnlineCostFit(min_calls=1)
    calls(fit, 0.0, 1.5)
    scaled = fit.scaled(profile)
    assert scaled.alpha == pytest.approx(3e-6) and scaled.call_overhead == pytest.approx(1.5e-5)
    assert (scaled.beta, scaled.load_s, scaled.relevel_s) == (profile.beta, profile.load_s, profile.relevel_s)
    assert "refitted" in scaled.source
