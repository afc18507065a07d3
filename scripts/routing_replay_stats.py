"""How the twin replays a shipped prefill-only log, measured: the figures of docs/deployments.md,
"Routing logs" (how decode is formed, and what it is worth). Prints

1. the top-k overlap of consecutive tokens of the log's windows, of any two tokens of a window,
   and of uniform picks (k / E): the temporal locality a decode step formed from the log carries;
2. for the batches `moeless eval` makes with its default sizes (ShareGPT lengths, 600 requests,
   8192 tokens, 256 sequences, load 0.8, 300 iterations, Poisson arrivals), the share of a
   batch's tokens whose routing no other token of the batch repeats, and the per-layer load CV
   per phase, beside the CV of the same number of distinct tokens of the log, of the held-out
   log, and of uniform picks.

    .venv/bin/python scripts/routing_replay_stats.py [--log flame-moe-290m --heldout flame-moe-290m-heldout]

Why a script: the figures back a claim in the docs (the twin's batches on this log are skewier than
a batch of many distinct requests) and must be re-measurable; the test suite checks the log's own
statistics (tests/twin/test_heldout_routing.py) but not the eval's batches, which need the
tokenizer's lengths.
"""

from __future__ import annotations

import argparse
from collections import Counter

import numpy as np

from moeless.evaluation.deployment import DeploymentSizes
from moeless.evaluation.lengths import dataset_lengths
from moeless.traces.routing_file import Routing
from moeless.traces.shipped import load_named_routing
from moeless.twin.chunked import scale_to_load, schedule, split_counts, step_loads


def overlap(a: np.ndarray, b: np.ndarray, k: int) -> float:
    """Mean shared experts / k of token pairs a[i], b[i] ([n, L, k] each)."""
    return float((a[..., :, None] == b[..., None, :]).sum(-1).sum(-1).mean() / k)


def load_cv(topk: np.ndarray, experts: int) -> float:
    """Mean over layers of the CV of per-expert picks of tokens topk [n, L, k]."""
    counts = np.stack([np.bincount(topk[:, l].ravel(), minlength=experts) for l in range(topk.shape[1])])
    return float((counts.std(1) / counts.mean(1)).mean())


def locality(routing: Routing, rng: np.random.Generator) -> None:
    """Step 1: consecutive tokens, any two tokens of a window, uniform picks."""
    k = routing.top_k
    windows = [routing.request(r) for r in range(len(routing.lengths))]
    for l in range(routing.num_layers):
        consecutive = np.mean([overlap(w[:-1, l:l + 1], w[1:, l:l + 1], k) for w in windows])
        print(f"  layer {l}: consecutive tokens {consecutive:.3f}")
    consecutive = np.mean([overlap(w[:-1], w[1:], k) for w in windows])
    i, j = rng.integers(0, min(len(w) for w in windows), (2, 20_000))
    far = np.abs(i - j) > 1
    anywhere = np.mean([overlap(w[i[far]], w[j[far]], k) for w in windows])
    print(f"  all layers: consecutive {consecutive:.3f}, any two of a window {anywhere:.3f}, "
          f"uniform picks {k / routing.num_experts:.3f}")


def batches(routing: Routing, heldout: Routing, rng: np.random.Generator) -> None:
    """Step 2: the eval's batches on the log: distinct routing per batch and load CV per phase."""
    s = DeploymentSizes(max_iterations=300)
    prompts, outputs, note = dataset_lengths("sharegpt", s.requests)
    n = s.requests
    p, o = prompts[np.arange(n) % len(prompts)], outputs[np.arange(n) % len(outputs)]
    arrivals = np.cumsum(rng.exponential(1.0, n))
    times = scale_to_load(arrivals, p, o, s.load, s.max_batched_tokens, s.step_s)
    steps = schedule(times, p, o, s.max_batched_tokens, s.max_seqs, s.step_s, max_iterations=s.max_iterations)
    iterations = step_loads(steps, p, split_counts(routing))
    sizes, R = routing.lengths, len(routing.lengths)
    found: dict[str, list] = {"prefill": [], "decode": []}
    for step, it in zip(steps, iterations):
        keys = Counter((r % R, (t if t < p[r] else t - p[r]) % sizes[r % R]) for r, first, m in step.chunks
                       for t in range(first, first + m))
        load = it.load.astype(np.float64)
        found[step.phase].append((len(keys) / step.tokens, float((load.std(1) / load.mean(1)).mean()), step.tokens))
    print(f"  {note}; {len(steps)} iterations")
    e, k = routing.num_experts, routing.top_k
    for phase, rows in found.items():
        distinct, cv, tokens = (np.array(c) for c in zip(*rows))
        m = int(np.median(tokens))
        same = np.mean([load_cv(routing.topk[rng.choice(len(routing.topk), m, replace=False)], e) for _ in range(200)])
        held = np.mean([load_cv(heldout.topk[rng.choice(len(heldout.topk), min(m, len(heldout.topk)), replace=False)], e)
                        for _ in range(200)])
        uniform = np.mean([load_cv(np.argsort(rng.random((m, routing.num_layers, e)), -1)[..., :k], e) for _ in range(200)])
        print(f"  {phase}: {len(rows)} iterations, median {m} tokens; distinct routing {distinct.mean():.2f} of a batch's "
              f"tokens; load CV {cv.mean():.3f} (median batch: {m} distinct tokens of the log {same:.3f}, of the held-out "
              f"log {held:.3f}, uniform picks {uniform:.3f})")


def main() -> None:
    parser = argparse.ArgumentParser(description="How the twin replays a shipped prefill-only routing log, measured")
    parser.add_argument("--log", default="flame-moe-290m", help="a shipped log's name or a routing file (default flame-moe-290m)")
    parser.add_argument("--heldout", default="flame-moe-290m-heldout", help="the log whose distinct tokens are compared")
    args = parser.parse_args()
    rng = np.random.default_rng(0)
    routing, heldout = load_named_routing(args.log), load_named_routing(args.heldout)
    print(f"{routing.label}\n1. top-k overlap (shared experts / k):")
    locality(routing, rng)
    print("2. the eval's batches:")
    batches(routing, heldout, rng)


if __name__ == "__main__":
    main()
