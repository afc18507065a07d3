"""What the serving replicas tell the planning loop, and what the loop keeps of it: pure data.

Each ModelServer sends one IterationReport per forward pass (fire and forget). The planning loop
keeps them in a ReportWindow (the last window_s seconds of every replica: the forecast it plans
with, merged with time weights) and adds them to LiveStats (per phase and layer: MoE-layer times,
the slowest host's compute, the tokens it received, cold starts, the latency model's prediction,
calibrated and refitted online; what /metrics and `moeless bench live` read). Heartbeat says
whether the loop still runs. Time is injected (clock()), so all of it is tested on a fake clock.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Callable

import numpy as np

PHASES = ("prefill", "decode")
# Upper bounds of the MoE-layer time histogram (seconds): 20 us .. 0.5 s.
TIME_BUCKETS = (2e-5, 5e-5, 1e-4, 2e-4, 5e-4, 1e-3, 2e-3, 5e-3, 1e-2, 2e-2, 5e-2, 0.1, 0.2, 0.5)


@dataclass(frozen=True)
class LayerFigures:
    """Per MoE layer of one forward pass, each [L]:

    wall_s: the layer's expert call as the serving replica waited for it (scatter, hosts, gather);
    compute_s: the slowest host's compute (its own clock: thread CPU time on a CPU);
    host_tokens: the most tokens one host received; host_calls: hosts called;
    cold_starts: replicas the call had to load first; model_s: the latency model's serial compute
    time for the same tokens on the same replicas (max over hosts of alpha * tokens + call overhead
    per replica; no transfer); imbalance: max over hosts of their tokens / the mean (1: even);
    cv: coefficient of variation of the tokens of the replicas that got any.
    """

    wall_s: np.ndarray
    compute_s: np.ndarray
    host_tokens: np.ndarray
    host_calls: np.ndarray
    cold_starts: np.ndarray
    model_s: np.ndarray
    imbalance: np.ndarray
    cv: np.ndarray

    @staticmethod
    def empty(num_layers: int) -> "LayerFigures":
        return LayerFigures(*(np.zeros(num_layers) for _ in range(8)))


@dataclass(frozen=True)
class IterationReport:
    """One forward pass of one serving replica.

    replica: which ModelServer; ended_s: when it ended (wall clock); duration_s: its forward's wall
    time; phase: "prefill" or "decode"; tokens: rows through the experts per layer;
    actual: [L, E] tokens per expert; forecast: [L, E] the predictor's forecast (None without a
    predictor); accuracy: the predictor's online load accuracy (NaN: none yet); forecast_s: time the
    forecasting added to the forward; layers: per-layer figures.
    """

    replica: str
    ended_s: float
    duration_s: float
    phase: str
    tokens: int
    actual: np.ndarray
    forecast: np.ndarray | None
    accuracy: float
    forecast_s: float
    layers: LayerFigures


class ReportWindow:
    """The reports of every replica that ended in the last window_s seconds."""

    def __init__(self, window_s: float = 2.0, clock: Callable[[], float] | None = None):
        if window_s <= 0:
            raise ValueError(f"window_s must be > 0, got {window_s}")
        self.window_s = window_s
        self.clock = clock
        self._reports: deque[IterationReport] = deque()

    def add(self, report: IterationReport) -> None:
        self._reports.append(report)

    def reports(self, now: float) -> list[IterationReport]:
        """The reports still inside the window at `now` (older ones are dropped)."""
        while self._reports and self._reports[0].ended_s < now - self.window_s:
            self._reports.popleft()
        return list(self._reports)

    def merged(self, now: float, source: str = "forecast", phase: str | None = None) -> np.ndarray | None:
        """Tokens per expert of a typical iteration: [L, E], the mean of the reports' `source`
        ("forecast" or "actual") weighted by each iteration's duration (so the plan serves the time
        the layers take), over the reports of `phase` (None: all); None without such reports."""
        reports = [r for r in self.reports(now) if getattr(r, source) is not None and phase in (None, r.phase)]
        if not reports:
            return None
        weights = np.array([max(r.duration_s, 1e-9) for r in reports])
        stacked = np.stack([np.asarray(getattr(r, source), dtype=np.float64) for r in reports])
        return np.tensordot(weights / weights.sum(), stacked, axes=1)

    def samples(self, now: float, source: str = "forecast", phase: str | None = None) -> np.ndarray | None:
        """The reports' `source` themselves, [B, L, E] in order (a planner that plans on samples of
        the batches to come, placement/replica_sets.py), over the reports of `phase`; None without."""
        reports = [r for r in self.reports(now) if getattr(r, source) is not None and phase in (None, r.phase)]
        return np.stack([np.asarray(getattr(r, source), dtype=np.float64) for r in reports]) if reports else None

    def iteration_s(self, now: float, default: float = 0.05) -> float:
        """Mean seconds between one replica's iterations (their duration), or `default`."""
        reports = self.reports(now)
        return float(np.mean([r.duration_s for r in reports])) if reports else default


@dataclass
class PhaseStats:
    """Sums over the layer calls of one phase: totals and per layer ([L] arrays)."""

    num_layers: int
    iterations: int = 0
    forward_s: float = 0.0
    forecast_s: float = 0.0
    buckets: np.ndarray = field(init=False)
    per_layer: dict[str, np.ndarray] = field(init=False)
    calls: np.ndarray = field(init=False)

    FIELDS = ("wall_s", "compute_s", "host_tokens", "host_calls", "cold_starts", "model_s")
    SUMS = (*FIELDS, "model_online_s")

    def __post_init__(self) -> None:
        self.buckets = np.zeros(len(TIME_BUCKETS) + 1, dtype=np.int64)  # the last: +Inf
        self.per_layer = {name: np.zeros(self.num_layers) for name in self.SUMS}
        self.calls = np.zeros(self.num_layers, dtype=np.int64)

    def add(self, report: IterationReport, model_online_s: np.ndarray | None = None) -> None:
        self.iterations += 1
        self.forward_s += report.duration_s
        self.forecast_s += report.forecast_s
        ran = report.layers.host_calls > 0  # a layer with no tokens made no call
        self.calls += ran
        for name in self.FIELDS:
            self.per_layer[name] += np.where(ran, getattr(report.layers, name), 0.0)
        online = report.layers.model_s if model_online_s is None else model_online_s
        self.per_layer["model_online_s"] += np.where(ran, online, 0.0)
        self.buckets += np.bincount(np.searchsorted(TIME_BUCKETS, report.layers.wall_s[ran]),
                                    minlength=len(TIME_BUCKETS) + 1)

    def mean(self, name: str) -> float:
        """Mean over every layer call of the phase."""
        calls = int(self.calls.sum())
        return float(self.per_layer[name].sum() / calls) if calls else float("nan")

    def as_dict(self) -> dict:
        return {"iterations": self.iterations, "layer_calls": int(self.calls.sum()), "forward_s": self.forward_s,
                "forecast_s": self.forecast_s, "calls_per_layer": self.calls.tolist(),
                **{f"sum_{name}": self.per_layer[name].tolist() for name in self.SUMS},
                **{f"mean_{name}": self.mean(name) for name in self.FIELDS},
                "time_buckets": list(TIME_BUCKETS), "bucket_counts": self.buckets.tolist()}


class LiveStats:
    """Every report since the start (or the last reset), per phase, and the latest per-layer
    load figures (for gauges)."""

    def __init__(self, num_layers: int):
        self.num_layers = num_layers
        self.reset()

    def reset(self) -> None:
        self.phases = {phase: PhaseStats(self.num_layers) for phase in PHASES}
        self.imbalance = np.ones(self.num_layers)
        self.cv = np.zeros(self.num_layers)
        self.load_max_over_mean = np.ones(self.num_layers)
        self.accuracy = float("nan")
        self.replicas: set[str] = set()

    def add(self, report: IterationReport, model_online_s: np.ndarray | None = None) -> None:
        """model_online_s [L]: each call's compute as the refitted latency model predicted it before
        the report came (controller/planning/cost_fit.py); None: the calibrated model's (layers.model_s)."""
        if report.phase not in self.phases:
            raise ValueError(f"unknown phase {report.phase!r}; use one of {PHASES}")
        self.phases[report.phase].add(report, model_online_s)
        ran = report.layers.host_calls > 0
        self.imbalance = np.where(ran, report.layers.imbalance, self.imbalance)
        self.cv = np.where(ran, report.layers.cv, self.cv)
        actual = np.asarray(report.actual, dtype=np.float64)
        mean = actual.mean(axis=1)
        self.load_max_over_mean = np.where(mean > 0, actual.max(axis=1) / np.where(mean > 0, mean, 1.0),
                                           self.load_max_over_mean)
        if not np.isnan(report.accuracy):
            self.accuracy = report.accuracy
        self.replicas.add(report.replica)

    def as_dict(self) -> dict:
        return {"phases": {p: s.as_dict() for p, s in self.phases.items()}, "imbalance": self.imbalance.tolist(),
                "cv": self.cv.tolist(), "load_max_over_mean": self.load_max_over_mean.tolist(),
                "accuracy": self.accuracy, "replicas": sorted(self.replicas)}


class Heartbeat:
    """When the loop last finished a pass; stalled once that is older than threshold_s."""

    def __init__(self, clock: Callable[[], float], threshold_s: float = 2.0):
        if threshold_s <= 0:
            raise ValueError(f"threshold_s must be > 0, got {threshold_s}")
        self.clock, self.threshold_s = clock, threshold_s
        self.last = clock()
        self.beats = 0

    def beat(self) -> None:
        self.last = self.clock()
        self.beats += 1

    def age(self) -> float:
        return self.clock() - self.last

    def stalled(self) -> str | None:
        """None while the loop runs, else the line /healthz shows."""
        age = self.age()
        return f"degraded: planning loop stalled for {age:.1f} s" if age > self.threshold_s else None
