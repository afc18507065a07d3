"""A chunked-prefill scheduler as vLLM's, and the per-iteration loads it makes from routing.

`schedule` is pure: arrivals [N] seconds, prompt lengths [N] and output lengths [N] tokens ->
iterations, each a list of (request, first token, tokens). Per iteration, with a budget of
max_batched_tokens tokens and at most max_seqs requests holding a slot:
1. decode: every running request whose prompt is done feeds its last generated token (1 token);
2. prefill chunks: running requests still in their prompt continue it, oldest first, as far as the
   budget goes;
3. admission: arrived requests join, oldest first, while a slot and budget are left, each with
   the first chunk of its prompt the budget allows.
The iteration that runs a prompt's last chunk yields the first output token, so a request with
output G decodes G - 1 times (token P + s at decode step s). An iteration is "prefill" when it runs
any prompt tokens (chunked prefill mixes them with decodes), else "decode". The clock advances
iteration_s + token_s x tokens per iteration and jumps over idle time.
`scale_to_load` sets the arrival rate so the offered tokens are `load` x the scheduler's capacity.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moeless.twin.iterations import Iteration
from moeless.traces.routing_file import Routing
from moeless.twin.routing import cumulative_counts, token_loads


@dataclass(frozen=True)
class Step:
    """One scheduled iteration: time_s, phase, chunks ((request, first token, tokens), ...)."""

    time_s: float
    phase: str
    chunks: tuple[tuple[int, int, int], ...]

    @property
    def tokens(self) -> int:
        return sum(n for _, _, n in self.chunks)


def schedule(arrivals: np.ndarray, prompt_lens: np.ndarray, output_lens: np.ndarray, max_batched_tokens: int,
             max_seqs: int, iteration_s: float, token_s: float = 0.0, max_iterations: int = 10_000) -> list[Step]:
    """The iterations of the scheduler (see the module docstring); arrivals non-decreasing."""
    arrivals, prompts, outputs = (np.asarray(a) for a in (arrivals, prompt_lens, output_lens))
    if not (len(arrivals) == len(prompts) == len(outputs)) or len(arrivals) == 0:
        raise ValueError(f"need one arrival, prompt and output length per request, got {len(arrivals)}, {len(prompts)}, {len(outputs)}")
    if max_batched_tokens <= 0 or max_seqs <= 0 or iteration_s <= 0 or (prompts <= 0).any() or (outputs <= 0).any():
        raise ValueError("max_batched_tokens, max_seqs, iteration_s and every prompt and output length must be positive")
    done = np.zeros(len(arrivals), np.int64)  # tokens fed so far (prompt, then decode)
    total = prompts + outputs - 1  # tokens a request feeds: its prompt, then G - 1 generated ones
    running: list[int] = []
    nxt, now, out = 0, float(arrivals[0]), []
    while len(out) < max_iterations and (running or nxt < len(arrivals)):
        if not running and arrivals[nxt] > now:
            now = float(arrivals[nxt])
        budget, chunks = max_batched_tokens, []
        # 1. Decodes, then 2. prompt chunks of running requests, oldest first.
        for r in sorted(running, key=lambda r: done[r] < prompts[r]):
            n = min(1 if done[r] >= prompts[r] else prompts[r] - done[r], budget)
            if n > 0:
                chunks.append((r, int(done[r]), int(n)))
                budget -= n
        # 3. Admission while a slot and budget are left.
        while nxt < len(arrivals) and arrivals[nxt] <= now and len(running) < max_seqs and budget > 0:
            n = min(int(prompts[nxt]), budget)
            chunks.append((nxt, 0, n))
            running.append(nxt)
            budget -= n
            nxt += 1
        for r, _, n in chunks:
            done[r] += n
        phase = "prefill" if any(first < prompts[r] for r, first, _ in chunks) else "decode"
        step = Step(now, phase, tuple(chunks))
        out.append(step)
        running = [r for r in running if done[r] < total[r]]
        now += iteration_s + token_s * step.tokens
    return out


def split_counts(routing: Routing) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per routing request, cumulative counts of its prompt tokens [P + 1, L, E] and of its decode
    tokens [S + 1, L, E] (its prompt's when it has no decode token)."""
    out = []
    for cum, prompt in zip(cumulative_counts(routing), routing.prompt_tokens):
        p = int(prompt) if 0 < prompt < len(cum) - 1 else len(cum) - 1
        out.append((cum[:p + 1], cum[p:] - cum[p] if p < len(cum) - 1 else cum))
    return out


def step_loads(steps: Sequence[Step], prompt_lens: np.ndarray, counts: Sequence[tuple[np.ndarray, np.ndarray]]) -> list[Iteration]:
    """Iterations with their loads [L, E]. Request r replays routing request r mod R (counts from
    split_counts): its prompt token t the routed prompt token t mod P, its decode step s the
    routed decode token s mod S (a request longer than the recorded one cycles)."""
    out = []
    for s in steps:
        load = 0
        for r, first, n in s.chunks:
            prompt, decode = counts[r % len(counts)]
            p = int(prompt_lens[r])
            load = load + (token_loads(prompt, first, n) if first < p else token_loads(decode, first - p, n))
        out.append(Iteration(s.phase, np.asarray(load, np.int64), len(s.chunks), (), s.time_s))
    return out


def scale_to_load(arrivals: np.ndarray, prompt_lens: np.ndarray, output_lens: np.ndarray, load: float,
                  max_batched_tokens: int, iteration_s: float) -> np.ndarray:
    """Arrival times [N] rescaled so that the offered tokens per second (rate x mean prompt plus
    output) are `load` x the capacity max_batched_tokens / iteration_s (load 1: saturated)."""
    if load <= 0:
        raise ValueError(f"load must be positive, got {load}")
    span = float(arrivals[-1] - arrivals[0])
    if span <= 0:
        return np.asarray(arrivals, np.float64)
    rate = (len(arrivals) - 1) / span
    offered = rate * float(np.mean(np.asarray(prompt_lens) + np.asarray(output_lens)))
    capacity = max_batched_tokens / iteration_s
    factor = offered / (load * capacity)  # > 1 stretches time
    return arrivals[0] + (np.asarray(arrivals, np.float64) - arrivals[0]) * factor
