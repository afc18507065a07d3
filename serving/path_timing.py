"""Serving's paths (experts in-process, over each transport) timed against each other: every
MoE-layer call timed (TimedExecutor), the paths paired call by call on the same input (outputs
compared bit for bit, PairedExecutor), or each path alone (run_alone); greedy generations of a
batch as static and continuous batching run them, and ping-pong runs over them. `moeless bench
serve` drives them, and so do scripts/gpu_serving_check.py and scripts/k8s_helm_e2e.py.

Paired, a remote path's hosts sit idle while the other paths run the same layer (milliseconds),
so every call finds them asleep; serving gives them only the model's other layers between calls.
`run_alone` therefore also times each path by itself, batch by batch in rotating order, as
serving runs it, and checks that it generates what the paired run generated.
"""

from __future__ import annotations

import time

import numpy as np
import torch
from tqdm import tqdm

from moeless.model.interface import ExpertExecutor, Routing


class TimedExecutor:
    """Wraps an executor and records (tokens, seconds) of each run_layer call."""

    def __init__(self, inner: ExpertExecutor):
        self.inner, self.samples = inner, []

    def run_layer(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        start = time.perf_counter()
        out = self.inner.run_layer(layer, x, routing)
        self.samples.append((x.shape[0], time.perf_counter() - start))
        return out

    def summary_ms(self, batch: int) -> dict[str, dict[str, float]]:
        """Mean, median, 10th and 90th percentile ms per layer call, for all calls, prefill and decode
        apart. A decode step carries one row per sequence (<= batch). The median resists a busy
        machine's stalls; the 10th percentile is what the machine gives when other jobs leave it
        alone (a path of several processes waits for the CPU at every hand-over, so contention
        inflates it more than the single-process baseline)."""
        phases = {"all": [s for _, s in self.samples], **{p: [s for t, s in self.samples if phase_of(t, batch) == p]
                                                          for p in ("prefill", "decode")}}
        return {name: {"mean": 1e3 * float(np.mean(v)), "median": 1e3 * float(np.median(v)),
                       "p10": 1e3 * float(np.percentile(v, 10)), "p90": 1e3 * float(np.percentile(v, 90)),
                       "calls": len(v)}
                for name, v in phases.items() if v}


def phase_of(rows: int, batch: int) -> str:
    """A layer call's phase by its rows: a decode step carries one per sequence (<= batch), a prefill more."""
    return "prefill" if rows > batch else "decode"


def rotated(names: list[str], shift: int) -> list[str]:
    """names in turn order `shift`: each path first once every len(names) turns (none always meets
    the machine after the same neighbour)."""
    shift %= len(names)
    return names[shift:] + names[:shift]


def generate_batch(engine, chunk: list[list[int]], max_tokens: int) -> list[list[int]]:
    """Greedy generations of one batch of prompts (token ids per prompt)."""
    rows: list[list[int]] = [[] for _ in chunk]
    for step in engine.token_steps(chunk, [max_tokens] * len(chunk)):
        for r, token in enumerate(step):
            if token is not None:
                rows[r].append(token)
    return rows


def generate_continuous(engine, chunk: list[list[int]], max_tokens: int) -> tuple[list[list[int]], dict[str, list]]:
    """Greedy generations of one batch as continuous batching runs them: one prefill of every prompt
    (packed), then decode steps over KVSlots until each has max_tokens -> (tokens per prompt,
    per phase ("prefill", "decode") a (seconds, transfer seconds) pair per forward; transfer: the
    executor's time waiting for its hosts beyond their compute (LayerTimes), 0 in-process)."""
    from moeless.serving.kv_slots import KVSlots  # transformers: kept off --help's start-up path

    def transfer_s() -> float:
        times = getattr(engine.executor, "times", None)
        return 0.0 if times is None else times.invoke_s - times.compute_s

    def timed(phase: str, forward):
        start, moved = time.perf_counter(), transfer_s()
        out = forward()
        seconds[phase].append((time.perf_counter() - start, transfer_s() - moved))
        return out

    seconds: dict[str, list] = {"prefill": [], "decode": []}
    first, kv = timed("prefill", lambda: engine.prefill(chunk))
    slots = KVSlots(engine.model.spec.num_layers, len(chunk))
    for i, (prompt, (cache, column)) in enumerate(zip(chunk, kv)):
        slots.add(i, cache, 0, column, len(prompt))
    rows = [[token] for token in first]
    for _ in range(max_tokens - 1):
        for row, token in zip(rows, timed("decode", lambda: engine.decode(slots, [r[-1] for r in rows]))):
            row.append(token)
    return rows, seconds


def run_pingpong(engines: dict[str, object], batches: list[list[list[int]]], max_tokens: int,
                 prefill_rounds: int = 3) -> dict:
    """Every engine (name -> Engine: in-process, and each remote path with 1 and 2 micro-batches)
    generates every batch by continuous batching's forwards, the order rotating batch by batch,
    then prefills it `prefill_rounds` times more (the forwards that split, timed more often) ->
    per engine and phase the p50 ms of a forward and of its transfer (see generate_continuous), and
    the generations that differ from the first engine's."""
    figures: dict[str, dict[str, list]] = {name: {"prefill": [], "decode": []} for name in engines}
    differ = dict.fromkeys(engines, 0)
    names = list(engines)
    for i, chunk in enumerate(tqdm(batches, desc="ping-pong", leave=False)):
        for round_ in range(1 + prefill_rounds):
            rows = {}
            turn = i + round_
            for name in rotated(names, turn):
                rows[name], seconds = generate_continuous(engines[name], chunk, max_tokens if round_ == 0 else 1)
                for phase, forwards in seconds.items():
                    figures[name][phase] += forwards
            if round_ == 0:
                for name in names:
                    differ[name] += sum(a != b for a, b in zip(rows[name], rows[names[0]]))
    return {name: {phase: {"ms": 1e3 * float(np.median([s for s, _ in f])),
                           "transfer_ms": 1e3 * float(np.median([t for _, t in f])), "forwards": len(f)}
                   for phase, f in phases.items() if f}
            | {"generations_differing": differ[name]}
            for name, phases in figures.items()}


class PairedExecutor:
    """Runs every layer call on each path (name -> (TimedExecutor, torch threads)), the order
    rotating call by call; returns the first path's output and counts, per path, the calls whose
    output is not bit-identical to it."""

    def __init__(self, paths: dict[str, tuple[TimedExecutor, int]], threads: int):
        self.paths, self.threads = paths, threads
        self.mismatches = dict.fromkeys(paths, 0)
        self._calls = 0

    def run_layer(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        names = list(self.paths)
        order = rotated(names, self._calls)
        self._calls += 1
        outputs = {}
        for name in order:
            executor, threads = self.paths[name]
            torch.set_num_threads(threads)
            outputs[name] = executor.run_layer(layer, x, routing)
        torch.set_num_threads(self.threads)
        reference = outputs[names[0]]
        for name, out in outputs.items():
            self.mismatches[name] += not torch.equal(out, reference)
        return reference


def run_alone(make_engine, paths: dict[str, tuple[ExpertExecutor, int]], batches: list[list[list[int]]], max_tokens: int,
              reference: list[list[list[int]]]) -> tuple[dict[str, TimedExecutor], dict[str, int]]:
    """Every path generates every batch by itself (path order rotating batch by batch), each on its
    torch threads: name -> TimedExecutor of its calls, and name -> generations that differ from
    `reference` (the paired run's rows per batch). make_engine(executor) -> an Engine."""
    timed = {name: TimedExecutor(executor) for name, (executor, _) in paths.items()}
    engines = {name: make_engine(executor) for name, executor in timed.items()}
    differ = dict.fromkeys(paths, 0)
    names = list(paths)
    for i, chunk in enumerate(batches):
        for name in rotated(names, i):
            before = torch.get_num_threads()
            torch.set_num_threads(paths[name][1])
            rows = generate_batch(engines[name], chunk, max_tokens)
            torch.set_num_threads(before)
            differ[name] += sum(a != b for a, b in zip(rows, reference[i]))
    return timed, differ
