"""The Ray Serve application: an HTTP ingress and N data-parallel replicas of the non-expert layers.

    Ingress (FastAPI)  --handle-->  ModelServer x N  --gRPC, one call per host per layer-->  expert hosts

ModelServer holds the model with its routed experts dropped (embeddings, attention, norms,
gates, shared experts, LM head) and a RemoteExecutor over the expert hosts. Requests are
batched continuously (moeless.serving.scheduler: a request joins the running batch at the next
iteration and leaves when it ends), or statically with batching="static" (serve.batch: a batch
decodes to its longest request; the baseline of `moeless bench load`); either way each request
streams its events (moeless.serving.engine). The ingress (moeless.serving.ingress) validates
requests, formats OpenAI-style responses and server-sent events, and serves /healthz and
/metrics. `drain` stops a replica for shutdown: no new requests (503), running ones finish within a deadline or fail with
a 503 that says so.
"""

import asyncio
import functools
import os
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, AsyncIterator

from ray import serve

from moeless.controller.planning.board import BoardFollower
from moeless.controller.pool.sources import follow_pool
from moeless.controller.pool.wake import waker_for
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.placement.types import Placement
from moeless.predictor.build import build_predictor
from moeless.serving import api
from moeless.serving.config import ServeConfig, config_from_args
from moeless.serving.engine import Engine, error_event
from moeless.serving.family import FamilyExecutor
from moeless.serving.executor import RemoteExecutor
from moeless.serving.ingress import Ingress
from moeless.serving.live import start_live
from moeless.serving.live_engine import LiveEngine
from moeless.serving.placement_source import PlacementSource
from moeless.serving.scheduler import Scheduler, SchedulerLoop
from moeless.serving.shutdown import DrainWatcher
from moeless.serving.step_gate import step_gate_for

INGRESS_SPARE = 16  # ingress requests beyond the servers' capacity: health and metrics probes


@serve.deployment
class ModelServer:
    """One data-parallel replica of the non-expert layers."""

    def __init__(self, config: ServeConfig):
        import torch

        torch.set_num_threads(config.torch_threads)
        # Decoding runs here, off the event loop; OpenMP's thread count is per thread, so set it in the worker too.
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="decode", initializer=torch.set_num_threads,
                                           initargs=(config.torch_threads,))
        model = config.model_loader()
        runtime = None
        if config.plan_loop:  # before drop_experts: a predictor file is checked against the whole model
            runtime = build_predictor(model, config.knobs.predictor, config.knobs.distance, config.predictor_file)
        model.drop_experts()
        if config.device != "cpu":  # after the drop: only the non-expert layers take the GPU's memory
            if not torch.cuda.is_available():
                raise RuntimeError(f"replica on {config.device}: Ray gave this replica no GPU it can see "
                                   f"(CUDA_VISIBLE_DEVICES={os.environ.get('CUDA_VISIBLE_DEVICES')!r}); check the "
                                   "node's GPUs and the replica's num_gpus, or serve with --device cpu")
            model.to(config.device)
            if runtime is not None:
                runtime.primary.to(config.device)
        spec = model.spec
        self.pool, self.pool_follower = follow_pool(config.pool_source, functools.partial(_client, config,
                                                                                           config.host_model),
                                                    config.pool_period_s)
        self._probes: dict[str, Any] = {}  # address -> a client with a short timeout: /healthz answers fast
        self.host_model = config.host_model
        self.source = PlacementSource(config.placement or Placement.static(spec.num_layers, spec.num_experts,
                                                                             self.pool.slots))
        self.waker = waker_for(config.pool_source)  # a k8s pool at zero is woken by the request that finds it so
        if config.family:  # its ESFT fine-tunes in this engine: each token to its own model's experts
            members = (config.host_model, *(config.family_hosts or config.family))  # the hosts' names for them
            self.executor = FamilyExecutor(self.pool, self.source, members, waker=self.waker)
        else:
            self.executor = RemoteExecutor(self.pool, self.source, waker=self.waker)
        self.follower = None
        if config.placement_board:
            self.follower = BoardFollower(self.source, name=config.placement_board)
        self.live, engine_type = None, Engine
        if config.plan_loop:
            self.live = start_live(config, model, self.executor, runtime, config.profile)
            self.executor, engine_type = self.live.executor, LiveEngine
        self.engine = engine_type(model, self.executor, micro_batches=config.micro_batches,
                                  micro_batch_tokens=config.micro_batch_tokens,
                                  members=(config.model_name, *config.family) if config.family else ())
        self.scheduler = self.loop = None
        if config.batching == "continuous":
            gate = None if config.step_slo_s is None else \
                step_gate_for(config.step_slo_s, self.live.profile, spec, self.pool, self.live.loop, self.follower,
                              hold_s=config.step_hold_s, hold_newcomers=config.step_admit == "wait",
                              slos=dict(config.step_slos_s))
            self.scheduler = Scheduler(self.engine, config.limits, gate=gate)
            self.loop = SchedulerLoop(self.scheduler, threads=config.torch_threads)
        self._batched.set_max_batch_size(config.max_batch)
        self._batched.set_batch_wait_timeout_s(config.batch_wait_s)
        self._inflight = 0
        self._draining = False
        self.watcher = None
        if config.drain_signal:
            self.watcher = DrainWatcher(self.drain, name=config.drain_signal)

    async def generate(self, request: api.GenerationRequest) -> AsyncIterator[list[dict]]:
        """The request's events, a list per iteration (call with handle.options(stream=True))."""
        if self._draining:
            yield [error_event(api.ApiError(503, "the server is shutting down; retry on another replica",
                                            code="shutting_down"))]
            return
        # A request that finds nothing in flight and whose first token waits for cold starts (the
        # hosts gave its model's replicas back) or for the pool to wake is a wake of its model: the
        # ingress meters its time to first token per model (moeless_model_wake_seconds).
        quiet, started = self._inflight == 0, time.monotonic()
        cold, woken = self.executor.times.cold_starts, self.waker.wakes if self.waker else 0
        self._inflight += 1
        try:
            steps = self._continuous(request) if self.scheduler else self._batched(request)
            async for events in steps:
                if quiet:
                    quiet, loads = False, self.executor.times.cold_starts - cold
                    if loads > 0 or (self.waker is not None and self.waker.wakes > woken):
                        events = [{"wake": {"seconds": time.monotonic() - started, "cold_starts": loads}}, *events]
                yield events
        finally:
            self._inflight -= 1

    async def _continuous(self, request: api.GenerationRequest) -> AsyncIterator[list[dict]]:
        loop = asyncio.get_running_loop()
        queue: asyncio.Queue = asyncio.Queue()
        try:
            rid = self.scheduler.submit(request, lambda events: loop.call_soon_threadsafe(queue.put_nowait, events))
        except api.ApiError as err:
            yield [error_event(err)]
            return
        try:
            while True:
                events = await queue.get()
                yield events
                if any("finish" in e or "error" in e for e in events):
                    return
        finally:  # also when the client went away (the generator is closed or cancelled)
            self.scheduler.cancel(rid)

    def drain(self, timeout_s: float) -> dict:
        """Stop admitting (503); wait up to timeout_s for the requests in flight, then fail the
        rest with a 503 that says so. Returns {"unfinished": requests failed at the deadline}.
        Runs on the DrainWatcher's thread (a handle call would reach one replica only)."""
        self._draining = True
        if self.scheduler:
            self.scheduler.drain()
        deadline = time.monotonic() + timeout_s
        while self._inflight and time.monotonic() < deadline:
            time.sleep(0.05)
        unfinished = self._inflight
        if unfinished and self.scheduler:
            self.scheduler.abort(f"the server shut down before this request finished (drain deadline "
                                 f"{timeout_s:g} s); retry on another replica")
            while self._inflight and time.monotonic() < deadline + 5.0:
                time.sleep(0.05)
        if self.loop:
            self.loop.stop()
        return {"unfinished": unfinished}

    @serve.batch(max_batch_size=8)  # the bare form refuses async generators; __init__ sets the config's values
    async def _batched(self, requests: list[api.GenerationRequest]) -> AsyncIterator[list]:
        """Per step, each request's list of events; StopIteration once a request is done."""
        loop = asyncio.get_running_loop()
        steps = self.engine.run(requests)
        done, first = [False] * len(requests), True
        while not all(done):
            events = await loop.run_in_executor(self._decoder, next, steps, None)
            if events is None:
                return
            if first:  # tell each request how many it was batched with (for the ingress' metrics)
                events, first = [[{"batch": len(requests)}] + evs for evs in events], False
            out = []
            for i, evs in enumerate(events):
                out.append(StopIteration if done[i] else evs)
                done[i] = done[i] or any("finish" in e or "error" in e for e in evs)
            yield out

    def health(self) -> dict:
        """Which expert hosts of the pool answer now (hosts: those in the pool or there but not
        ready; pool: the slots in use; slots: the pool's size)."""
        addresses = self.pool.addresses()
        for gone in set(self._probes) - set(addresses.values()):
            self._probes.pop(gone).close()
        live = []
        for slot, address in sorted(addresses.items()):
            probe = self._probes.setdefault(address, ExpertHostClient(address, timeout_s=2.0, model=self.host_model))
            try:
                probe.health()
                live.append(slot)
            except Exception:  # any failure means "not serving"; the reason is in the host's log
                pass
        not_ready = sorted(self.pool.not_ready())  # there but not serving: starting, dead, draining
        return {"hosts": len(addresses) + len(not_ready), "slots": self.pool.slots, "pool": sorted(addresses),
                "not_ready": not_ready, "live_hosts": live, "dead_hosts": sorted(self.executor.dead_hosts),
                "draining": self._draining, "waking": bool(self.waker and self.waker.waking)}

    def stats(self) -> dict:
        batching = {"running": 0, "waiting": 0, "iterations": 0, "refused": 0}
        if self.scheduler:
            batching = {**self.scheduler.counts(), "iterations": self.scheduler.stats.iterations,
                        "refused": self.scheduler.stats.refused, "busy_s": self.scheduler.stats.busy_s,
                        "decode_tokens": self.scheduler.stats.decode_tokens,
                        "step_gate": self.scheduler.gate.figures() if self.scheduler.gate else None}
        return {**self.executor.times.as_dict(), "dead_hosts": sorted(self.executor.dead_hosts),
                "placement_version": self.source.version, "pool_version": self.pool.version,
                "local_channels": sum(c.uses_local_channel for c in self.pool.clients().values()),
                "paths": {slot: c.path for slot, c in self.pool.clients().items()},  # each host's data path now
                "wake": self.waker.stats() if self.waker else None,
                "standby_hosts": sorted(self.follower.standby) if self.follower else [],  # what a switch may run
                "split_forwards": self.engine.split_forwards, **batching}


def _client(config: ServeConfig, model: str | None, address: str) -> ExpertHostClient:
    """A client of the host at address for `model` (the name the hosts serve it by), with config's settings."""
    return ExpertHostClient(address, timeout_s=config.host_timeout_s, transport=config.transport,
                            poll_s=config.client_poll_s, model=model)


def build_app(configs: ServeConfig | list[ServeConfig]):
    """The bound application, for serve.run(build_app(configs), route_prefix="/"): one ModelServer
    deployment per config (a model, with the fine-tunes of its family: serving/family.py), one ingress
    that routes each request by its `model`."""
    configs = [configs] if isinstance(configs, ServeConfig) else list(configs)
    names = [name for c in configs for name in (c.model_name, *c.family)]
    if len(set(names)) != len(names):
        raise ValueError(f"each served model needs its own name, got {names}")
    servers, admitted = {}, 0
    for i, config in enumerate(configs):
        ongoing = config.limits.max_running + config.limits.max_waiting if config.batching == "continuous" \
            else 4 * config.max_batch
        name = "ModelServer" if len(configs) == 1 else f"ModelServer-{i}"
        server = ModelServer.options(
            name=name, num_replicas=config.num_replicas, max_ongoing_requests=ongoing,
            ray_actor_options={"num_cpus": config.replica_cpus, "num_gpus": config.replica_gpus}).bind(config)
        servers |= {model: server for model in (config.model_name, *config.family)}
        admitted += config.num_replicas * ongoing
    # The ingress holds each streamed request until its last token: it must admit every request the
    # servers can take (Ray Serve's default of 5 ongoing would cap the running batch at 5), plus
    # room for /healthz and /metrics.
    return Ingress.options(max_ongoing_requests=admitted + INGRESS_SPARE,
                           ray_actor_options={"num_cpus": configs[0].ingress_cpus}).bind(
        servers, {c.model_name: c.plan_loop for c in configs})


def app_from_args(args: dict):
    """The application from Ray Serve's args (a RayService's import path `moeless.serving.app:app_from_args`):
    {"config": the knobs' YAML file, "model", "hosts" (default $MOELESS_EXPERT_HOSTS), "replicas"}."""

    return build_app(config_from_args(args))
