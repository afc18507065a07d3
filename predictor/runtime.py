"""Prediction off the critical path, with an online accuracy check and a history fallback.

While layer l computes, `begin(l, d, ...)` hands the forecast of layer l + d to a worker thread
on its own CUDA stream, so it overlaps the layer's kernels; when layer l + d is planned,
`forecast(l + d)` collects it. On a CPU there is no idle unit to overlap with, and the hand-over
to a thread costs more than the forecast (a one-off timing on 2 cores, 30 layers, gate replicas:
6.1 ms an iteration through the thread against 1.1 ms inline at 4 tokens, 32 against 6.6 at 256), so
CPU tensors are forecast inline in `begin` (`threaded=None`, the default); the time is the
caller's to measure and report (serving/live_executor.py: forecast_s). After the layer runs,
`report` scores the primary predictor's forecast against the actual load (load accuracy). When
the mean over the last `window` reports falls under `floor`, the runtime serves the fallback
(history) forecasts and says so in its metrics; the primary keeps running in the shadow and
takes over again once its accuracy is back above `floor + margin`.

Forwards in flight together (micro-batches, serving/pingpong.py) each pass a `lane` of their own,
so one's forecast of layer l + d is not the other's; the predictors and the accuracy window are
shared (one model of the traffic).
"""

from __future__ import annotations

import contextlib
import math
import logging
import threading
from collections import deque
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Hashable

import numpy as np
import torch

from moeless.predictor.base import Forecast, Predictor
from moeless.predictor.metrics import load_accuracy

log = logging.getLogger(__name__)


class PredictionRuntime:
    """Forecasts from `primary` (a worker thread for CUDA tensors, inline for CPU ones), falling back
    to `fallback` under an accuracy floor."""

    def __init__(self, primary: Predictor, fallback: Predictor, floor: float = 0.7, window: int = 32, margin: float = 0.05,
                 threaded: bool | None = None):
        """threaded: forecasts on the worker thread always (True), never (False), or for CUDA
        tensors only (None)."""
        if not 0.0 <= floor <= 1.0:
            raise ValueError(f"accuracy floor must be in [0, 1], got {floor}")
        if window < 1:
            raise ValueError(f"accuracy window must be at least 1 report, got {window}")
        self.primary, self.fallback = primary, fallback
        self.floor, self.margin, self.threaded = floor, margin, threaded
        self._scores: deque[float] = deque(maxlen=window)
        self._pending: dict[tuple, Future] = {}  # (lane, target layer) -> Future[(primary, fallback or None)]
        self._served: dict[tuple, Forecast] = {}  # (lane, target layer) -> the primary's forecast, for scoring
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="moeless-predictor")
        self._lock = threading.Lock()  # predictors are not thread-safe: predict and observe take turns
        self._streams: dict[torch.device, torch.cuda.Stream] = {}
        self.fallback_active = False
        self.fallback_switches = 0
        self.forecasts = 0

    # 1. Start a forecast while the source layer computes.
    def begin(self, source: int, distance: int, hidden: torch.Tensor, trajectory: np.ndarray, lane: Hashable = 0) -> None:
        """Forecast layer source + distance in the background. hidden: [T, H]; trajectory: [source+1, E]."""
        target = (lane, source + distance)
        ready = None
        if hidden.is_cuda:  # the side stream must not read hidden before the main stream wrote it
            ready = torch.cuda.Event()
            ready.record(torch.cuda.current_stream(hidden.device))
        shadow = self.fallback_active
        if self.threaded or (self.threaded is None and hidden.is_cuda):
            self._pending[target] = self._pool.submit(self._run, source, distance, hidden, trajectory, ready, shadow)
            return
        done: Future = Future()
        try:
            done.set_result(self._run(source, distance, hidden, trajectory, ready, shadow))
        except Exception as err:  # raised where a thread's would be: at forecast()
            done.set_exception(err)
        self._pending[target] = done

    def _run(self, source: int, distance: int, hidden: torch.Tensor, trajectory: np.ndarray, ready, with_fallback: bool):
        with self._lock, self._on_side_stream(hidden, ready):
            primary = self.primary.predict(source, distance, hidden, trajectory)
            backup = self.fallback.predict(source, distance, hidden, trajectory) if with_fallback else None
        return primary, backup

    def _on_side_stream(self, hidden: torch.Tensor, ready):
        if ready is None:
            return contextlib.nullcontext()
        stream = self._streams.setdefault(hidden.device, torch.cuda.Stream(device=hidden.device))
        stream.wait_event(ready)
        return torch.cuda.stream(stream)

    # 2. Collect it when the target layer is planned.
    def forecast(self, target: int, lane: Hashable = 0) -> Forecast:
        """The forecast to plan layer `target` with (blocks until the background work is done)."""
        try:
            future = self._pending.pop((lane, target))
        except KeyError:
            raise KeyError(f"no forecast was begun for layer {target} in lane {lane!r}; call begin(source, distance, "
                           "...) first") from None
        primary, backup = future.result()
        self._served[(lane, target)] = primary
        self.forecasts += 1
        return backup if backup is not None else primary

    # 3. Score the primary once the layer has run; switch to or from the fallback.
    def report(self, target: int, actual_load: np.ndarray, lane: Hashable = 0) -> float:
        """Score the primary's forecast of `target` against actual_load [E]; returns its load accuracy."""
        forecast = self._served.pop((lane, target), None)
        if forecast is None:
            raise KeyError(f"no forecast of layer {target} was served in lane {lane!r}; call forecast({target}) "
                           "before report")
        score = float(load_accuracy(forecast.load, np.asarray(actual_load)))
        if np.isnan(score):
            return score  # a layer with no tokens says nothing about accuracy
        self._scores.append(score)
        online = self.online_accuracy
        if not self.fallback_active and online < self.floor:
            self.fallback_active, self.fallback_switches = True, self.fallback_switches + 1
            log.warning("predictor %s: online load accuracy %.3f under floor %.3f; serving %s forecasts", self.primary.name, online, self.floor, self.fallback.name)
        elif self.fallback_active and online >= self.floor + self.margin:
            self.fallback_active = False
            log.info("predictor %s: online load accuracy %.3f recovered; serving it again", self.primary.name, online)
        return score

    def end_iteration(self, loads: np.ndarray, trajectory: np.ndarray) -> None:
        """Both predictors observe a finished iteration: loads [L, E], trajectory [L, E]."""
        with self._lock:
            self.primary.observe(loads, trajectory)
            self.fallback.observe(loads, trajectory)

    @property
    def online_accuracy(self) -> float:
        """Mean load accuracy of the primary over the last `window` reports (NaN before any)."""
        # fsum, not np.mean: this runs after every layer of every forward, and np.mean of a deque costs ~14 us
        return math.fsum(self._scores) / len(self._scores) if self._scores else float("nan")

    def metrics(self) -> dict[str, float]:
        """Prometheus-style gauges and counters of the runtime."""
        return {
            "moeless_predictor_online_load_accuracy": self.online_accuracy,
            "moeless_predictor_fallback_active": float(self.fallback_active),
            "moeless_predictor_fallback_switches_total": float(self.fallback_switches),
            "moeless_predictor_forecasts_total": float(self.forecasts),
        }

    def close(self) -> None:
        self._pool.shutdown(wait=True)

    def __enter__(self) -> "PredictionRuntime":
        return self

    def __exit__(self, *exc) -> None:
        self.close()
