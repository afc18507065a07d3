"""The HTTP ingress of the Ray Serve app: OpenAI-style routes over the ModelServer replicas.

It validates requests (moeless.serving.api), streams each request's events from the ModelServer
of the model the request names (one app may serve several models, each with its own servers and
planning loop, on shared expert hosts), and serves /healthz (ok / degraded while an expert host or
a planning loop is down / draining / waking; with several models, each model's under "models")
and /metrics (its own counters, the servers' stats and the planning loops', each loop's labelled
by its model when there are several). serving/app.py binds it to the servers.
"""

# No `from __future__ import annotations`: FastAPI must see the real `Request` type of the routes.
import asyncio
import time
from typing import AsyncIterator

import ray
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, StreamingResponse
from prometheus_client import generate_latest
from ray import serve

from moeless.controller.planning.names import NAMESPACE
from moeless.controller.planning.metrics import LoopCollector, LoopsCollector, loop_health
from moeless.controller.pool.wake import health_word
from moeless.serving import api
from moeless.serving.engine import error_event
from moeless.serving.ingress_metrics import IngressMetrics


# Helpers of the ingress sit above it: serve.ingress ships the class by value with what it references.
def _as_api_error(event: dict) -> api.ApiError:
    e = event["error"]
    return api.ApiError(e["status"], e["message"], code=e.get("code"), param=e.get("param"))


async def _chain(first: dict, rest: AsyncIterator[dict]) -> AsyncIterator[dict]:
    yield first
    async for event in rest:
        yield event


web = FastAPI(title="moeless", description="OpenAI-style completions over serverless MoE experts")


class _Loop:
    """What the ingress knows of one model's planning loop: its actor (found lazily), its last state
    and the collector /metrics reads."""

    def __init__(self, name: str | None, model: str | None):
        self.name, self.actor, self.state = name, None, None
        self.metrics = LoopCollector(model)


@serve.deployment
@serve.ingress(web)
class Ingress:
    def __init__(self, servers: dict, plan_loops: dict):
        """servers: model name -> its ModelServer handle; plan_loops: model name -> its loop actor's name (or None)."""
        self.servers = servers
        self.metrics = IngressMetrics()
        several = len(servers) > 1
        self.loops = {model: _Loop(plan_loops.get(model), model if several else None) for model in servers}
        self.metrics.registry.register(LoopsCollector([loop.metrics for loop in self.loops.values() if loop.name]))

    @web.get("/v1/models")
    async def models(self) -> dict:
        return {"object": "list", "data": [{"id": name, "object": "model", "owned_by": "moeless"} for name in self.servers]}

    @web.post("/v1/completions")
    async def completions(self, request: Request):
        return await self._serve("completions", request, api.parse_completion)

    @web.post("/v1/chat/completions")
    async def chat(self, request: Request):
        return await self._serve("chat", request, api.parse_chat)

    @web.get("/healthz")
    async def healthz(self):
        models = {}
        for model, server in self.servers.items():
            health = await server.health.remote()
            status, word = health_word(health)
            if self.loops[model].name:
                degraded, health["plan_loop"] = await self._loop_health(self.loops[model])
                if degraded and status == 200:
                    word, health["detail"] = "degraded", health["plan_loop"]["state"]
            models[model] = (status, {"status": word, **health})
        status, body = max(models.values(), key=lambda sb: sb[0])  # the worst model's answer leads
        if len(models) > 1:
            body = {**body, "models": {model: doc for model, (_, doc) in models.items()}}
        return JSONResponse(body, status)

    async def _loop_health(self, loop: _Loop, method: str = "state") -> tuple[bool, dict]:
        """What a planning loop says (waiting at most a second: a stalled loop may not answer)."""
        answered, result = False, None
        try:
            if loop.actor is None:
                loop.actor = ray.get_actor(loop.name, namespace=NAMESPACE)
            result = await asyncio.wait_for(getattr(loop.actor, method).remote(), timeout=1.0)
            loop.state, answered = result, True
        except Exception:  # not started yet, gone, or not answering: judged on what it said last
            pass
        degraded, detail = loop_health(loop.state, None, time.time(), answered)
        if method == "metrics":
            age = time.time() - loop.state["heartbeat_s"] if loop.state else 0.0
            loop.metrics.update(result, age, degraded)
        return degraded, detail

    @web.get("/metrics")
    async def metrics(self):
        engines = {server.deployment_name: server for server in self.servers.values()}  # a family: one for its models
        stats = [await server.stats.remote() for server in engines.values()]
        self.metrics.dead_hosts.set(max(len(s["dead_hosts"]) for s in stats))  # the hosts are shared
        for gauge, key in ((self.metrics.retries, "retries"), (self.metrics.running, "running"),
                           (self.metrics.waiting, "waiting"), (self.metrics.refused, "refused"),
                           (self.metrics.split_forwards, "split_forwards"), (self.metrics.baton, "baton_s")):
            gauge.set(sum(s[key] for s in stats))
        self.metrics.set_wake(stats[0]["wake"])
        self.metrics.set_step_gates([s.get("step_gate") for s in stats])
        self.metrics.set_paths({slot: path for s in stats for slot, path in s["paths"].items()})
        for loop in self.loops.values():
            if loop.name:
                await self._loop_health(loop, "metrics")
        return PlainTextResponse(generate_latest(self.metrics.registry).decode(),
                                 media_type="text/plain; version=0.0.4")

    async def _serve(self, route: str, request: Request, parse):
        start = time.perf_counter()
        try:
            req = parse(api.parse_json(await request.body()), list(self.servers))
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
                yield api.sse(api.chunk_body(req, rid, "", event["finish"],
                                             api.usage(event["prompt_tokens"], tokens)))
                break
        yield api.sse("[DONE]")
        self._count(route, status, start, tokens)

    async def _events(self, req: api.GenerationRequest) -> AsyncIterator[dict]:
        """The model server's events for one request, one at a time."""
        try:
            async for events in self.servers[req.model].options(stream=True).generate.remote(req):
                for event in events:
                    if "batch" in event:
                        self.metrics.batch.observe(event["batch"])
                    elif "wake" in event:
                        self.metrics.observe_wake(req.model, event["wake"])
                    else:
                        yield event
        except Exception as err:  # the replica died or Ray failed: the client still gets an answer
            yield error_event(err)

    def _count(self, route: str, status: int, start: float, tokens: int = 0) -> None:
        self.metrics.requests.labels(route, str(status)).inc()
        self.metrics.tokens.inc(tokens)
        self.metrics.latency.labels(route).observe(time.perf_counter() - start)
