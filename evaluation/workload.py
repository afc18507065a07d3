"""A workload of `moeless eval`: an arrival trace and a prompt set, turned into serving iterations
with their real loads and forecasts.

Spec (the `--workload` flag): `[NAME=]TRACE[:PROMPTS]`. TRACE is a trace file (Azure CSV or
Mooncake JSONL), a trace of the traces folder by name (azure-conv, azure-code, mooncake), or
`generated`; PROMPTS is sharegpt (its test split, held out from the predictor's training) or
humaneval. Arrival i replays prompt i mod P (P distinct prompts traced through the model); with a
trace that records output lengths, request i decodes the trace's GeneratedTokens (output_length)
tokens, capped at the tokens traced per prompt.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Sequence

import numpy as np

from moeless.core.threads import torch_threads
from moeless.traces.sources import requests_from
from moeless.twin import arrivals as arr
from moeless.twin.batching import compose
from moeless.twin.forecasts import accuracy, forecast_set
from moeless.twin.iterations import Iteration

PROMPTS = ("sharegpt", "humaneval")


class WorkloadError(ValueError):
    """A workload spec that cannot be read (the message says what the spec should look like)."""


@dataclass(frozen=True)
class WorkloadSpec:
    """name: the workload's label in reports; trace: a path, a named trace or None (generated);
    prompts: one of PROMPTS."""

    name: str
    trace: str | None
    prompts: str


def parse_workload(text: str) -> WorkloadSpec:
    """`[NAME=]TRACE[:PROMPTS]` -> WorkloadSpec (see the module docstring)."""
    name, _, rest = text.rpartition("=") if "=" in text else ("", "", text)
    trace, prompts = rest, "sharegpt"
    head, sep, tail = rest.rpartition(":")
    if sep and tail in PROMPTS:
        trace, prompts = head, tail
    elif sep and "/" not in tail and "." not in tail:
        raise WorkloadError(f"--workload {text!r}: unknown prompts {tail!r}; use one of {', '.join(PROMPTS)}")
    if not trace:
        raise WorkloadError(f"--workload {text!r}: expected [NAME=]TRACE[:PROMPTS], TRACE a file, "
                            f"{', '.join(arr.NAMED_TRACES)} or generated")
    name = name or (trace if trace in (*arr.NAMED_TRACES, "generated") else Path(trace).stem)
    if not name.replace("-", "").replace("_", "").isalnum():
        raise WorkloadError(f"--workload {text!r}: a name is letters, digits, '-' and '_' (it names files), got {name!r}")
    return WorkloadSpec(name, None if trace == "generated" else trace, prompts)


@dataclass(frozen=True)
class Sizes:
    """How much of the workload to replay: requests (arrivals, the cap), prompts (distinct prompts
    traced), new_tokens (decode tokens traced per prompt), time_scale (arrival times x this),
    step_s, max_batch, max_iterations; rate and cv of the generated process; its seed."""

    requests: int = 400
    prompts: int = 96
    new_tokens: int = 32
    time_scale: float = 1.0
    step_s: float = 0.05
    max_batch: int = 32
    max_iterations: int = 4000
    rate: float = arr.DEFAULT_RATE
    cv: float = arr.DEFAULT_CV
    seed: int = 0


@dataclass
class Batched:
    """One batching of the workload: iterations [I], forecasts {(kind, d): [I, L, E]}, accuracy rows."""

    iterations: list[Iteration]
    forecasts: dict[tuple[str, int], np.ndarray]
    accuracy: list[dict] = field(default_factory=list)


@dataclass
class Workload:
    spec: WorkloadSpec
    arrivals: arr.Arrivals
    loads_note: str
    facts: object  # model/shape.ModelFacts
    top_k: int
    batchings: dict[str, Batched]


def read_arrivals(spec: WorkloadSpec, sizes: Sizes) -> arr.Arrivals:
    """The workload's arrivals, capped and time-scaled (read first: a bad trace fails before any tracing)."""
    found = arr.resolve(spec.trace, sizes.requests, sizes.rate, sizes.cv, sizes.seed)
    return found.first(sizes.requests, sizes.time_scale)


def prepare(spec: WorkloadSpec, arrivals: arr.Arrivals, model: str, sizes: Sizes, distances: Sequence[int],
            batchings: Sequence[str]) -> Workload:
    """Trace the prompts through `model` ("default" or "tiny"; cached by model and predictor), then
    batch the arrivals each way and build every forecast kind at every distance."""
    # One torch thread: the predictor's many tiny gate calls stall at a multi-thread pool's barrier
    # on a busy machine (moeless.core.threads), which made tracing 10x slower here.
    with torch_threads(1):
        loads, forecasts, facts, note = requests_from(model, sizes.prompts, sizes.new_tokens, distances, spec.prompts)
    per_arrival, per_arrival_forecasts = _per_arrival(loads, forecasts, arrivals)
    first = loads[0]
    top_k = int(round(first.prefill[0].sum() / max(first.prompt_tokens, 1)))
    traced = forecasts[0].distances if forecasts else ()
    out = {}
    for mode in batchings:
        iterations = compose(mode, per_arrival, arrivals.seconds, sizes.step_s, sizes.max_batch, sizes.max_iterations)
        kinds = forecast_set(iterations, per_arrival_forecasts, [d for d in distances if d in traced] or [1], top_k)
        out[mode] = Batched(iterations, kinds, accuracy(kinds, iterations))
    return Workload(spec, arrivals, note, facts, top_k, out)


def _per_arrival(loads: list, forecasts: list | None, arrivals: arr.Arrivals) -> tuple[list, list | None]:
    """Request i of the arrivals: prompt i mod P, its decode rows cut to the trace's output length
    (a request generating G tokens has G - 1 decode steps after its prefill)."""
    n = len(arrivals.seconds)
    keep = [len(loads[i % len(loads)].decode) for i in range(n)]
    if arrivals.output_tokens is not None:
        keep = [min(k, max(int(g) - 1, 0)) for k, g in zip(keep, arrivals.output_tokens)]
    requests = [replace(loads[i % len(loads)], decode=loads[i % len(loads)].decode[:keep[i]]) for i in range(n)]
    if forecasts is None:
        return requests, None
    return requests, [replace(forecasts[i % len(forecasts)], decode=forecasts[i % len(forecasts)].decode[:keep[i]]) for i in range(n)]
