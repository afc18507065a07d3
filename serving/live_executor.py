"""Forecasts and measurements in the forward pass: the live loop's part inside a serving replica.

`LiveExecutor` wraps the RemoteExecutor that runs every MoE layer. Per layer l (x = the gate
input [T, H], the routing known):

1. records layer l's actual load (tokens per expert) and, if a forecast of layer l was begun d
   layers earlier, collects it and scores it (PredictionRuntime.report: online accuracy; under
   its floor the runtime serves the history window instead);
2. begins the forecast of layer l + d from x (the runtime's worker thread on a GPU, off the
   critical path; inline on a CPU, where the thread costs more than the forecast); the time begin
   and collect add to the forward is measured and reported;
3. runs the layer on the hosts (the RemoteExecutor re-levels each expert's tokens over the
   published replicas on the actual loads when the planner asks for it, serving/relevel.py);
4. at the iteration's last layer hands an IterationReport (phase, tokens, forecast [L, E],
   actual [L, E], per-layer times) to `sink`, which must not block (controller/planning/report_sender.ReportSender).

Layers t < d have no source layer in the same forward: their forecast is the history window's.
`LiveEngine` (serving/live_engine.py) tells the executor whether a forward is a prefill or a decode
step; the runtime is the `predictor` knob's (predictor/build.py).

With micro-batches in flight together (ping-pong, serving/pingpong.py) each micro-batch is an
iteration of its own: its own forecasts (a lane of the runtime), figures and report. That is what
the planner should see: each host call carries one micro-batch's tokens, so the window's typical
iteration is the call the placement serves.
"""

from __future__ import annotations

import time
from typing import Callable

import numpy as np
import torch

from moeless.controller.planning.window import IterationReport, LayerFigures
from moeless.model.interface import Routing
from moeless.placement.latency_model import LatencyModel
from moeless.predictor.runtime import PredictionRuntime
from moeless.serving.executor import RemoteExecutor
from moeless.serving.pingpong import micro_batch


class _Iteration:
    """One forward's (one micro-batch's) figures as its layers run: actual [L, E], forecast [L, E]."""

    def __init__(self, num_layers: int, num_experts: int):
        self.actual = np.zeros((num_layers, num_experts), dtype=np.int64)
        self.forecast = np.full((num_layers, num_experts), np.nan)
        self.figures = LayerFigures.empty(num_layers)
        self.forecast_s = 0.0
        self.started = time.perf_counter()


class LiveExecutor:
    """An ExpertExecutor around a RemoteExecutor: forecasts, actual loads and per-layer figures
    of every forward pass (see the module docstring)."""

    def __init__(self, inner: RemoteExecutor, num_layers: int, num_experts: int, *, replica: str,
                 sink: Callable[[IterationReport], None], runtime: PredictionRuntime | None = None,
                 distance: int = 1, model: LatencyModel | None = None, clock: Callable[[], float] = time.time):
        self.inner, self.runtime, self.distance = inner, runtime, distance
        self.num_layers, self.num_experts = num_layers, num_experts
        self.replica, self.sink, self.model, self.clock = replica, sink, model, clock
        self.phase = "prefill"
        self.iterations = 0
        self._running: dict[int, _Iteration] = {}  # micro-batch -> its forward's iteration

    def run_layer(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x: [T, H] -> [T, H] on the hosts; forecasting and reporting around the call."""
        lane = micro_batch()
        routing = routing.on_cpu()  # the loads are counted in numpy (and the inner executor plans there)
        if layer == 0:
            self._running[lane] = _Iteration(self.num_layers, self.num_experts)
        it = self._running[lane]
        load = np.bincount(routing.idx.numpy().reshape(-1), minlength=self.num_experts)
        it.actual[layer] = load
        # 1-2. Collect and score this layer's forecast; begin layer + d's (worker thread).
        if self.runtime is not None:
            began = time.perf_counter()
            if layer >= self.distance:
                it.forecast[layer] = self.runtime.forecast(layer, lane).load
                self.runtime.report(layer, load, lane)
            if layer + self.distance < self.num_layers:
                self.runtime.begin(layer, self.distance, x, np.zeros((layer + 1, self.num_experts)), lane)
            it.forecast_s += time.perf_counter() - began
        # 3. The layer on the hosts.
        self.inner.last_call = None
        started = time.perf_counter()
        out = self.inner.run_layer(layer, x, routing)
        self._record(it.figures, layer, time.perf_counter() - started)
        # 4. The report, at the last layer.
        if layer == self.num_layers - 1:
            self._finish(self._running.pop(lane), x.shape[0])
        return out

    def _record(self, f: LayerFigures, layer: int, wall_s: float) -> None:
        call = self.inner.last_call
        f.wall_s[layer] = wall_s
        if call is None or not call.batches:
            return
        tokens = {h: sum(counts) for h, (_, counts) in call.batches.items()}
        chunks = np.array([n for _, counts in call.batches.values() for n in counts], dtype=np.float64)
        f.compute_s[layer] = max(call.compute_s.values(), default=0.0)
        f.host_tokens[layer] = max(tokens.values())
        f.host_calls[layer] = len(call.batches)
        f.cold_starts[layer] = call.cold_starts
        f.imbalance[layer] = max(tokens.values()) * call.num_hosts / max(sum(tokens.values()), 1)
        f.cv[layer] = chunks.std() / chunks.mean() if chunks.size and chunks.mean() > 0 else 0.0
        if self.model is not None:  # the serial model's compute for the same chunks: max over hosts
            f.model_s[layer] = max(self.model.alpha * sum(counts) + self.model.call_overhead * len(counts)
                                   for _, counts in call.batches.values())

    def _finish(self, it: _Iteration, tokens: int) -> None:
        began = time.perf_counter()
        if self.runtime is not None:
            history = self.runtime.fallback
            dummy = torch.empty(tokens, 0)
            for t in range(min(self.distance, self.num_layers)):  # no source layer in this forward
                it.forecast[t] = history.predict(0, t, dummy, np.zeros((1, self.num_experts))).load
            self.runtime.end_iteration(it.actual, np.zeros((self.num_layers, self.num_experts)))
        it.forecast_s += time.perf_counter() - began
        self.iterations += 1
        report = IterationReport(
            replica=self.replica, ended_s=self.clock(), duration_s=time.perf_counter() - it.started, phase=self.phase,
            tokens=tokens, actual=it.actual, forecast=None if self.runtime is None else it.forecast,
            accuracy=float("nan") if self.runtime is None else self.runtime.online_accuracy,
            forecast_s=it.forecast_s, layers=it.figures)
        self.sink(report)

    def close(self) -> None:
        if self.runtime is not None:
            self.runtime.close()
        self.inner.close()

    # What the ModelServer reads of a RemoteExecutor.
    @property
    def times(self):
        return self.inner.times

    @property
    def dead_hosts(self) -> set[int]:
        return self.inner.dead_hosts

    @property
    def clients(self):
        return self.inner.clients
