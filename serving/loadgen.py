"""A load generator for the HTTP API: arrival times in, per-request TTFT, TPOT and tokens out.

    outcomes = replay(url, model, prompts, arrivals_s, max_tokens)        # open loop (a trace)
    outcomes = closed_loop(url, model, prompts, clients=32, max_tokens=16)  # N clients back to back
    figures = summarize(outcomes)

Every request is a streamed /v1/completions call (greedy), so the first text chunk marks the
time to first token; the last chunk carries the request's usage (completion tokens). Times are
measured from when the request was due (its arrival), so a client that falls behind its
schedule counts the delay. Used by `moeless bench load`; `moeless bench live` drives `replay`
with trace arrivals.
"""

from __future__ import annotations

import asyncio
import json
import time
from dataclasses import asdict, dataclass
from typing import Sequence

import numpy as np


@dataclass
class Outcome:
    """One request. Times in seconds from the start of the run; first_token_s None if none came."""

    index: int
    arrival_s: float  # when it was due
    first_token_s: float | None
    end_s: float
    completion_tokens: int
    status: int  # HTTP status (200 even when an error event ended the stream)
    error: str | None = None  # the error message, if the request failed
    text: str = ""

    @property
    def ttft_s(self) -> float | None:
        return None if self.first_token_s is None else self.first_token_s - self.arrival_s

    @property
    def tpot_s(self) -> float | None:
        """Time per output token after the first."""
        if self.first_token_s is None or self.completion_tokens < 2:
            return None
        return (self.end_s - self.first_token_s) / (self.completion_tokens - 1)


def replay(url: str, model: str | Sequence[str], prompts: Sequence[str], arrivals_s: Sequence[float],
           max_tokens: int | Sequence[int], *, timeout_s: float = 600.0) -> list[Outcome]:
    """Send prompts[i] at arrivals_s[i] seconds (open loop) and wait for every answer; model: one for
    every request, or each request's (mixed traffic over several served models)."""
    limits = [max_tokens] * len(prompts) if isinstance(max_tokens, int) else list(max_tokens)
    models = [model] * len(prompts) if isinstance(model, str) else list(model)

    async def run(client, start):
        async def one(i):
            await asyncio.sleep(max(0.0, start + arrivals_s[i] - time.perf_counter()))
            return await _request(client, url, models[i], i, prompts[i], limits[i], start, arrivals_s[i])
        return await asyncio.gather(*(one(i) for i in range(len(prompts))))

    return _with_client(run, len(prompts), timeout_s)


def closed_loop(url: str, model: str, prompts: Sequence[str], clients: int, max_tokens: int, *,
                duration_s: float | None = None, timeout_s: float = 600.0) -> list[Outcome]:
    """`clients` concurrent clients, each sending its next prompt when its last one is answered,
    until every prompt was sent (or duration_s passed)."""
    queue = list(range(len(prompts)))

    async def run(client, start):
        async def worker():
            done = []
            while queue and (duration_s is None or time.perf_counter() - start < duration_s):
                i = queue.pop(0)
                done.append(await _request(client, url, model, i, prompts[i], max_tokens, start,
                                           time.perf_counter() - start))
            return done
        results = await asyncio.gather(*(worker() for _ in range(clients)))
        return sorted((o for r in results for o in r), key=lambda o: o.index)

    return _with_client(run, clients, timeout_s)


def summarize(outcomes: Sequence[Outcome]) -> dict:
    """Throughput over the run (first arrival to last answer), TTFT and TPOT percentiles."""
    ok = [o for o in outcomes if o.error is None and o.status == 200]
    start = min((o.arrival_s for o in outcomes), default=0.0)
    wall = max((o.end_s for o in outcomes), default=0.0) - start
    tokens = sum(o.completion_tokens for o in ok)
    ttft = [o.ttft_s for o in ok if o.ttft_s is not None]
    tpot = [o.tpot_s for o in ok if o.tpot_s is not None]
    return {
        "requests": len(outcomes), "succeeded": len(ok), "failed": len(outcomes) - len(ok),
        "errors": sorted({o.error or f"HTTP {o.status}" for o in outcomes if o not in ok})[:5],
        "wall_s": wall, "completion_tokens": tokens, "tokens_per_s": tokens / wall if wall > 0 else 0.0,
        "requests_per_s": len(ok) / wall if wall > 0 else 0.0,
        "ttft_s": _percentiles(ttft), "tpot_s": _percentiles(tpot),
    }


def outcomes_json(outcomes: Sequence[Outcome]) -> list[dict]:
    return [{**asdict(o), "ttft_s": o.ttft_s, "tpot_s": o.tpot_s} for o in outcomes]


def _percentiles(values: list[float]) -> dict:
    if not values:
        return {"p50": None, "p99": None, "mean": None}
    return {"p50": float(np.percentile(values, 50)), "p99": float(np.percentile(values, 99)),
            "mean": float(np.mean(values))}


def _with_client(run, connections: int, timeout_s: float) -> list[Outcome]:
    import httpx

    async def main():
        limits = httpx.Limits(max_connections=connections + 1, max_keepalive_connections=connections + 1)
        async with httpx.AsyncClient(timeout=timeout_s, limits=limits) as client:
            return await run(client, time.perf_counter())

    return asyncio.run(main())


async def _request(client, url: str, model: str, index: int, prompt: str, max_tokens: int, start: float,
                   arrival_s: float) -> Outcome:
    """One streamed completion; never raises (a failure is recorded in the outcome)."""
    import httpx

    first, tokens, text, error, status = None, 0, [], None, 0
    doc = {"model": model, "prompt": prompt, "max_tokens": max_tokens, "stream": True}
    try:
        async with client.stream("POST", f"{url}/v1/completions", json=doc) as response:
            status = response.status_code
            if status != 200:
                error = (await response.aread()).decode(errors="replace")[:300]
            else:
                async for line in response.aiter_lines():
                    if not line.startswith("data: ") or line == "data: [DONE]":
                        continue
                    event = json.loads(line[6:])
                    if "error" in event:
                        error = event["error"]["message"]
                        break
                    piece = event["choices"][0]["text"]
                    if piece and first is None:
                        first = time.perf_counter() - start
                    text.append(piece)
                    if "usage" in event:
                        tokens = event["usage"]["completion_tokens"]
    except httpx.HTTPError as err:
        error = f"{type(err).__name__}: {err}"
    if first is None and tokens and error is None:  # every token was held back (a partial character)
        first = time.perf_counter() - start
    return Outcome(index, arrival_s, first, time.perf_counter() - start, tokens, status, error, "".join(text))
