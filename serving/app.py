"""The Ray Serve application: an HTTP ingress and N data-parallel replicas of the non-expert layers.

    Ingress (FastAPI)  --handle-->  ModelServer x N  --gRPC, one call per host per layer-->  expert hosts

ModelServer holds the model with its routed experts dropped (embeddings, attention, norms,
gates, shared experts, LM head) and a RemoteExecutor over the expert hosts. Concurrent requests
are batched (serve.batch): one batch decodes together and streams events per request
(moeless.serving.engine). The ingress validates requests (moeless.serving.api), formats
OpenAI-style responses and server-sent events, and serves /healthz and /metrics.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` type of the routes.
import asyncio
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, AsyncIterator, Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from ray import serve

from moeless.placement.types import Placement
from moeless.serving import api
from moeless.serving.engine import error_event


@dataclass(frozen=True)
class ServeConfig:
    """What the app serves and how. model_loader must be picklable (a function or partial)."""

    model_name: str
    model_loader: Callable[[], Any]  # () -> MoEModel, called once per ModelServer replica
    host_addresses: tuple[str, ...]
    placement: Placement | None = None  # default: static, one replica per expert
    num_replicas: int = 1
    replica_cpus: float = 0.5
    ingress_cpus: float = 0.25
    torch_threads: int = 1
    max_batch: int = 8
    batch_wait_s: float = 0.02
    host_timeout_s: float = 30.0
    placement_board: str | None = None  # follow placements published under this name (placement_board.py)


@serve.deployment
class ModelServer:
    """One data-parallel replica of the non-expert layers."""

    def __init__(self, config: ServeConfig):
        import torch

        from moeless.expert_fn.client import ExpertHostClient
        from moeless.serving.engine import Engine
        from moeless.serving.executor import RemoteExecutor
        from moeless.serving.placement_source import PlacementSource

        torch.set_num_threads(config.torch_threads)
        # Decoding runs here, off the event loop; OpenMP's thread count is per thread, so set it in the worker too.
        self._decoder = ThreadPoolExecutor(1, thread_name_prefix="decode", initializer=torch.set_num_threads,
                                           initargs=(config.torch_threads,))
        model = config.model_loader()
        model.drop_experts()
        spec = model.spec
        self.clients = [ExpertHostClient(a, timeout_s=config.host_timeout_s) for a in config.host_addresses]
        self.probes = [ExpertHostClient(a, timeout_s=2.0) for a in config.host_addresses]  # /healthz answers fast
        self.source = PlacementSource(config.placement or Placement.static(spec.num_layers, spec.num_experts,
                                                                             len(self.clients)))
        self.executor = RemoteExecutor(self.clients, self.source)
        self.follower = None
        if config.placement_board:
            from moeless.serving.placement_board import BoardFollower

            self.follower = BoardFollower(self.source, name=config.placement_board)
        self.engine = Engine(model, self.executor)
        self._batched.set_max_batch_size(config.max_batch)
        self._batched.set_batch_wait_timeout_s(config.batch_wait_s)

    async def generate(self, request: api.GenerationRequest) -> AsyncIterator[list[dict]]:
        """The request's events, a list per decoding step (call with handle.options(stream=True))."""
        async for events in self._batched(request):
            yield events

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
        """Which expert hosts answer now."""
        live = []
        for i, probe in enumerate(self.probes):
            try:
                probe.health()
                live.append(i)
            except Exception:  # any failure means "not serving"; the reason is in the host's log
                pass
        return {"hosts": len(self.clients), "live_hosts": live, "dead_hosts": sorted(self.executor.dead_hosts)}

    def stats(self) -> dict:
        return {**self.executor.times.as_dict(), "dead_hosts": sorted(self.executor.dead_hosts),
                "placement_version": self.source.version}


class _Metrics:
    """The ingress' Prometheus metrics (own registry, so several apps in one process do not clash)."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.requests = Counter("moeless_http_requests", "HTTP requests by route and status", ["route", "status"],
                                registry=self.registry)
        self.tokens = Counter("moeless_generated_tokens", "completion tokens generated", registry=self.registry)
        self.latency = Histogram("moeless_request_seconds", "request latency (whole response)", ["route"],
                                 registry=self.registry)
        self.dead_hosts = Gauge("moeless_dead_expert_hosts", "expert hosts the serving path marked dead",
                                registry=self.registry)
        self.batch = Histogram("moeless_batch_size", "requests decoded together, per request",
                               buckets=(1, 2, 4, 8, 16, 32, 64), registry=self.registry)
        self.retries = Gauge("moeless_layer_retries", "MoE layers re-run after a host failure (one replica)",
                             registry=self.registry)


# Helpers of the ingress sit above it: serve.ingress ships the class by value with what it references.
def _as_api_error(event: dict) -> api.ApiError:
    e = event["error"]
    return api.ApiError(e["status"], e["message"], code=e.get("code"), param=e.get("param"))


async def _chain(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    yield first
    async for event in rest:
        yield event


web = FastAPI(title="moeless", description="OpenAI-style completions over serverless MoE experts")


@serve.deployment
@serve.ingress(web)
class Ingress:
    def __init__(self, server, model_name: str):
        self.server = server
        self.model_name = model_name
        self.metrics = _Metrics()

    @web.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": self.model_name, "object": "model", "owned_by": "moeless"}]}

    @web.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve("completions", request, api.parse_completion)

    @web.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._serve("chat", request, api.parse_chat)

    @web.get("/healthz")
    async def healthz(self):
        health = await self.server.health.remote()
        status = 200 if health["live_hosts"] else 503
        return JSONResponse({"status": "ok" if status == 200 else "no expert host is serving", **health}, status)

    @web.get("/metrics")
    async def metrics(self):
        stats = await self.server.stats.remote()
        self.metrics.dead_hosts.set(len(stats["dead_hosts"]))
        self.metrics.retries.set(stats["retries"])
        return PlainTextResponse(generate_latest(self.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    async def _serve(self, route: str, request: Request, parse):
        start = time.perf_counter()
        try:
            req = parse(api.parse_json(await request.body()), [self.model_name])
            events = self._events(req)
            first = await anext(events)  # a bad prompt (too long) fails here, before any 200
            if "error" in first:
                raise _as_api_error(first)
        except api.ApiError as err:
            self._count(route, err.status, start)
            return JSONResponse(api.error_body(err), status_code=err.status)
        rid = api.new_id("chatcmpl" if req.is_chat else "cmpl")
        if req.stream:
            return StreamingResponse(self._sse(route, req, rid, first, events, start), media_type="text/event-stream")
        text = []
        async for event in _chain(first, events):
            if "error" in event:
                err = _as_api_error(event)
                self._count(route, err.status, start)
                return JSONResponse(api.error_body(err), status_code=err.status)
            if "text" in event:
                text.append(event["text"])
            if "finish" in event:
                self._count(route, 200, start, event["completion_tokens"])
                return api.completion_body(req, rid, "".join(text), event["finish"], event["prompt_tokens"],
                                           event["completion_tokens"])
        raise RuntimeError("the model server ended a request without a finish event")

    async def _sse(self, route, req, rid, first, events, start) -> AsyncIterator[str]:
        status, tokens = 200, 0
        async for event in _chain(first, events):
            if "error" in event:  # the 200 is already sent: the error travels as an event
                status = event["error"]["status"]
                yield api.sse(api.error_body(_as_api_error(event)))
                break
            if "text" in event:
                yield api.sse(api.chunk_body(req, rid, event["text"], None))
            if "finish" in event:
                tokens = event["completion_tokens"]
                yield api.sse(api.chunk_body(req, rid, "", event["finish"]))
                break
        yield api.sse("[DONE]")
        self._count(route, status, start, tokens)

    async def _events(self, req: api.GenerationRequest) -> AsyncIterator[dict]:
        """The model server's events for one request, one at a time."""
        try:
            async for events in self.server.options(stream=True).generate.remote(req):
                for event in events:
                    if "batch" in event:
                        self.metrics.batch.observe(event["batch"])
                    else:
                        yield event
        except Exception as err:  # the replica died or Ray failed: the client still gets an answer
            yield error_event(err)

    def _count(self, route: str, status: int, start: float, tokens: int = 0) -> None:
        self.metrics.requests.labels(route, str(status)).inc()
        self.metrics.tokens.inc(tokens)
        self.metrics.latency.labels(route).observe(time.perf_counter() - start)


def build_app(config: ServeConfig):
    """The bound application, for serve.run(build_app(config), route_prefix="/")."""
    server = ModelServer.options(num_replicas=config.num_replicas, max_ongoing_requests=4 * config.max_batch,
                                 ray_actor_options={"num_cpus": config.replica_cpus}).bind(config)
    return Ingress.options(ray_actor_options={"num_cpus": config.ingress_cpus}).bind(server, config.model_name)
