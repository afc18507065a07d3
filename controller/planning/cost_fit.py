"""The latency model refitted on the running machine: measured compute ~ a x model + b per call.

The cost profile is calibrated once, on an idle host. Under traffic the same calls take longer:
the hosts share cores with the serving replicas, caches are colder, and how much longer drifts
with the load (`moeless bench live` measured the idle calibration 30-50% short). So the planning
loop refits, from the layer calls the serving replicas report, with old calls forgotten:

    compute_s[call] ~ a * model_s[call] + b

model_s: the calibrated model's compute for the call (live_executor.py: max over hosts of alpha x
tokens + call_overhead x replicas); b: a host call's fixed cost, which the per-replica model
leaves out. Least squares with exponential forgetting (weights halve every half_life_s of report
time); until min_calls calls are in, the prior (a = 1, b = the calibration's host call cost) holds.

It is causal: `predict` uses only the calls added before, so the prediction of a call is what the
system knew when it made it (bench live's "online" model error). The planners plan with
`scaled(profile)`: alpha and call_overhead times a, so the trade between a replica's gain and its
cold start and memory follows what the machine delivers now.

Example: calls of model 1 and 2 us measured at 3 and 5 us fit a = 2, b = 1 us.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np

from moeless.placement.profile import CostProfile

HALF_LIFE_S = 30.0
MIN_CALLS = 60  # two iterations of the default model's 30 layers


def solve_scale(s_mm: float, s_mc: float, s_cc: float, s_my: float, s_cy: float) -> tuple[float, float] | None:
    """(a, b) minimising sum w (y - a m - b c)^2 from its weighted sums (s_mm = sum w m^2, s_mc =
    sum w m c, s_cc = sum w c^2, s_my = sum w m y, s_cy = sum w c y); a scale alone (b = 0) when
    the pair has no physical meaning (a <= 0 or b < 0) or the system is singular; None when not
    even a positive scale fits."""
    det = s_mm * s_cc - s_mc * s_mc
    if det > 1e-12 * max(s_mm * s_cc, 1e-300):
        a = (s_my * s_cc - s_mc * s_cy) / det
        b = (s_mm * s_cy - s_mc * s_my) / det
        if a > 0 and b >= 0:
            return float(a), float(b)
    if s_mm > 0 and s_my > 0:
        return float(s_my / s_mm), 0.0
    return None


def fit_scale(model_s: np.ndarray, calls: np.ndarray, measured_s: np.ndarray) -> tuple[float, float]:
    """(a, b) with measured ~ a x model + b x calls over rows (each a call or a sum of calls);
    (1, 0) when nothing fits."""
    m, c, y = (np.asarray(v, dtype=np.float64) for v in (model_s, calls, measured_s))
    fit = solve_scale(m @ m, m @ c, c @ c, m @ y, c @ y)
    return fit if fit is not None else (1.0, 0.0)


class OnlineCostFit:
    """The refit (see the module docstring); `add` the layer calls of each report as it comes."""

    def __init__(self, host_call_s: float = 0.0, half_life_s: float = HALF_LIFE_S, min_calls: int = MIN_CALLS):
        if not half_life_s > 0:
            raise ValueError(f"half_life_s must be > 0, got {half_life_s}")
        self.prior = (1.0, max(host_call_s, 0.0))
        self.half_life_s, self.min_calls = half_life_s, min_calls
        self.calls = 0
        self._sums = np.zeros(5)  # s_mm, s_mc, s_cc, s_my, s_cy
        self._latest: float | None = None
        self._fit = self.prior

    @property
    def coefficients(self) -> tuple[float, float]:
        """(a, b seconds): the fit, or the prior until min_calls calls are in."""
        return self._fit

    def predict(self, model_s: np.ndarray, ran: np.ndarray) -> np.ndarray:
        """Each call's predicted compute [L] (0 where no call ran) from the calls added so far."""
        a, b = self._fit
        return np.where(np.asarray(ran, dtype=bool), a * np.asarray(model_s, dtype=np.float64) + b, 0.0)

    def add(self, ended_s: float, model_s: np.ndarray, ran: np.ndarray, compute_s: np.ndarray) -> None:
        """A report's layer calls: model_s, ran (a call was made), compute_s, each [L]; ended_s: when
        the report ended (reports may come out of order: an older one counts less)."""
        ran = np.asarray(ran, dtype=bool)
        if not ran.any():
            return
        if self._latest is None or ended_s > self._latest:
            if self._latest is not None:
                self._sums *= 0.5 ** ((ended_s - self._latest) / self.half_life_s)
            self._latest = ended_s
        w = 0.5 ** ((self._latest - ended_s) / self.half_life_s)
        m = np.asarray(model_s, dtype=np.float64)[ran]
        y = np.asarray(compute_s, dtype=np.float64)[ran]
        self._sums += w * np.array([m @ m, m.sum(), float(len(m)), m @ y, y.sum()])
        self.calls += len(m)
        if self.calls >= self.min_calls:
            self._fit = solve_scale(*self._sums) or self._fit

    def scaled(self, profile: CostProfile) -> CostProfile:
        """The profile with its compute costs (alpha, call_overhead) times the fitted a."""
        a = self._fit[0]
        return replace(profile, alpha=profile.alpha * a, call_overhead=profile.call_overhead * a,
                       source=f"{profile.source}; compute x {a:.3g}, refitted on the running machine")

    def as_dict(self) -> dict:
        a, b = self._fit
        return {"a": a, "b_s": b, "calls": self.calls, "fitted": self.calls >= self.min_calls,
                "half_life_s": self.half_life_s}
