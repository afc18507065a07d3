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
   published replicas on the actual loads when the planner asks for it, `relevel_for`);
4. at the iteration's last layer hands an IterationReport (phase, tokens, forecast [L, E],
   actual [L, E], per-layer times) to `sink`, which must not block (controller/planning/report_sender.ReportSender).

Layers t < d have no source layer in the same forward: their forecast is the history window's.
`LiveEngine` tells the executor whether a forward is a prefill or a decode step.

With micro-batches in flight together (ping-pong, serving/pingpong.py) each micro-batch is an
iteration of its own: its own forecasts (a lane of the runtime), figures and report. That is what
the planner should see: each host call carries one micro-batch's tokens, so the window's typical
iteration is the call the placement serves.
"""

from __future__ import annotations

import logging
import time
from typing import Callable, Iterator, Sequence

import numpy as np
import torch

from moeless.controller.planning.window import IterationReport, LayerFigures
from moeless.core.paths import cache_dir
from moeless.model.interface import Routing
from moeless.placement.latency_model import LatencyModel
from moeless.placement.resident_planner import actual_shares
from moeless.placement.types import LayerPlacement
from moeless.predictor.fingerprint import model_hash
from moeless.predictor.gate_replica import all_pairs, gate_reuse
from moeless.predictor.history import HistoryPredictor
from moeless.predictor.runtime import PredictionRuntime
from moeless.predictor.store import PredictorFileError, load_predictor
from moeless.serving.engine import Engine
from moeless.serving.executor import Relevel, RemoteExecutor
from moeless.serving.pingpong import micro_batch

log = logging.getLogger(__name__)


def build_predictor(model, predictor: str, distance: int, path: str | None = None) -> PredictionRuntime | None:
    """The prediction runtime of the `predictor` knob for `model` (call before drop_experts: the
    predictor file is checked against the full model): "gate": the trained gate replicas of
    `moeless predictor train` (path, else the cache's file for this model), or, when there is
    none, the untrained gate copies (gate reuse), said in the log; the history window as the
    fallback. "history" and "off": None (the loop plans from the reported actual loads, or not
    at all)."""
    if predictor != "gate":
        return None
    spec = model.spec
    file = path or str(cache_dir() / "predictor" / f"gate-replicas-{model_hash(model)}.pt")
    try:
        primary, meta = load_predictor(file, model)
        if distance not in meta["distances"]:
            raise PredictorFileError(f"{file}: trained for distances {meta['distances']}, not {distance}")
        log.info("predictor: gate replicas from %s at distance %d", file, distance)
    except PredictorFileError as err:
        if path:
            raise
        log.warning("predictor: %s; forecasting with untrained gate copies (train them with `moeless predictor "
                    "train --distances %d` for better forecasts)", err, distance)
        primary = gate_reuse(model, all_pairs(spec.num_layers, [distance]))
    return PredictionRuntime(primary, HistoryPredictor(spec.num_layers, spec.num_experts, spec.top_k))


def relevel_for(model: LatencyModel, cost_s: float) -> Relevel:
    """The RemoteExecutor's per-call shares on the layer's actual tokens per expert
    (`actual_shares`: re-levelled where that can save more than cost_s, the profile's relevel_s,
    else the better of the planned shares and static EP's split), the rule the twin prices it by."""

    def relevel(layer: int, placement: LayerPlacement, routing: Routing, num_hosts: int) -> LayerPlacement:
        num_experts = int(placement.expert.max()) + 1
        load = np.bincount(routing.idx.numpy().reshape(-1), minlength=num_experts)
        return actual_shares(load, placement, model, num_hosts, cost_s)[0]

    return relevel


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


class LiveEngine(Engine):
    """The Engine, telling its LiveExecutor the phase of every forward (prefill or decode)."""

    def prefill(self, prompts: Sequence[list[int]]):
        self.executor.phase = "prefill"
        return super().prefill(prompts)

    def decode(self, slots, tokens: Sequence[int]) -> list[int]:
        self.executor.phase = "decode"
        return super().decode(slots, tokens)

    def token_steps(self, prompts: Sequence[list[int]], max_tokens: Sequence[int]) -> Iterator[list[int | None]]:
        """Static batches: the first step is the prefill, the rest decode."""
        self.executor.phase = "prefill"
        for tokens in super().token_steps(prompts, max_tokens):
            yield tokens
            self.executor.phase = "decode"
