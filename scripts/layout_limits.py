"""What layouts can reach on a deployment cell's batches, counting tokens and calls only (the serial
model, kernels.serial_time; no cold start, no memory, no data-plane cost): the figures behind
docs/deployments.md, "What a layout chosen ahead of a batch can reach". Per phase, the share of
the lossless bound's gain on the run's second half of

1. homes fitted on its first half (EPLB's packing of the summed loads, then up to 16 swaps on the
   iterations: placement/home_moves.py's step 2), as moeless's first move would choose them;
2. homes fitted on the second half itself (hindsight: the best fixed layout had the loads been known),
   and fitted on its even iterations, scored on its odd ones (the same loads, unseen batches: what
   of hindsight's lead is noise fitted rather than the loads' drift);
3. homes re-fitted every K iterations on the last W (free moves: how far a faster schedule gets);
4. per batch, up to S swaps of two experts chosen on the batch's own loads (each swap a pair of
   copies, so 2 S copies, chosen per batch: an oracle of copies);
5. P swap pairs chosen on the first half's last 64 iterations (each expert in one pair; a pair is
   a copy of x on y's home and of y on x's), each batch swapping those of them that lower its
   time on its own loads (what a dispatch-time decision with no cost of its own would make).

    .venv/bin/python scripts/layout_limits.py --gpu A6000x8 [--iterations 300]

Why a script: the figures explain the misses of issue 43's targets (docs/deployments.md) and must
be re-measurable; the placement suites test the rules it uses, not these figures.
"""

from __future__ import annotations

import argparse

import numpy as np

from moeless.controller.knobs import Knobs
from moeless.evaluation import deployment as D
from moeless.evaluation.deployment_run import DeploymentConfig, routing_for
from moeless.evaluation.lengths import dataset_lengths
from moeless.evaluation.workload import Sizes, parse_workload, read_arrivals
from moeless.hardware.gpus import parse_gpu_arg
from moeless.placement.home_fits import gpu_work, home_seconds, packed_homes, static_homes, swapped_homes
from moeless.twin.bound import profile_bound
from moeless.twin.geometry import load_geometry
from moeless.twin.roofline import resolve_profile

PHASES = ("prefill", "decode")


def cell_loads(gpu_arg: str, iterations: int, routing: str, geometry: str):
    """The eval's iterations of the cell (its default sizes, the conversation workload): loads [I, L, E], phases [I], profile."""
    sizes = D.DeploymentSizes(max_batched_tokens=8192, max_seqs=256, load=0.8, requests=600, max_iterations=iterations,
                              routing_prompts=24, routing_tokens=32, step_s=0.05)
    workload = parse_workload("conversation=azure-conv:sharegpt")
    config = DeploymentConfig((geometry,), (gpu_arg,), (workload,), routing, sizes, Knobs(keep_alive_s=60))
    geo = load_geometry(geometry)
    gpu, count = parse_gpu_arg(gpu_arg)
    arrivals = read_arrivals(workload, Sizes(requests=sizes.requests))
    prompts, outputs, _ = dataset_lengths(workload.prompts, sizes.requests)
    its = D.iterations_for(routing_for(config, geo, workload.prompts, False), prompts, outputs, arrivals.seconds,
                           sizes, geo.moe_layers)
    return np.stack([it.load for it in its]).astype(np.int64), np.array([it.phase for it in its]), \
        resolve_profile(None, geo, gpu, count), count


def fit(window: np.ndarray, num_gpus: int, model, swaps: int = 16) -> np.ndarray:
    """[W, L, E] -> homes [L, E]: packing on the sums, then swaps on the iterations."""
    packed = packed_homes(window.sum(axis=0), num_gpus)
    return np.stack([swapped_homes(window[:, l].astype(float), packed[l], num_gpus, model, swaps)
                     for l in range(window.shape[1])])


def swap_gains(x: np.ndarray, homes: np.ndarray, ea: np.ndarray, eb: np.ndarray, num_gpus: int, model) -> np.ndarray:
    """[P] seconds the layer would save on loads x [E] by swapping each pair's homes (negative: it loses)."""
    tokens, work = gpu_work(x, homes, num_gpus, model)
    ga, gb = homes[ea], homes[eb]
    dt = (x[eb] - x[ea]).astype(float)  # what ga gains and gb loses
    dw = model.alpha * dt + model.call_overhead * ((x[eb] > 0).astype(float) - (x[ea] > 0))
    after = (np.maximum(_max_without(work, ga, gb), np.maximum(work[ga] + dw, work[gb] - dw))
             + 2.0 * model.beta * np.maximum(_max_without(tokens, ga, gb), np.maximum(tokens[ga] + dt, tokens[gb] - dt)))
    return work.max() + 2.0 * model.beta * tokens.max() - after


def _max_without(values: np.ndarray, ga: np.ndarray, gb: np.ndarray) -> np.ndarray:
    """[P] the largest of values [G] over the GPUs other than ga[p] and gb[p] (0 if none)."""
    out, done = np.zeros(ga.shape[0]), np.zeros(ga.shape[0], bool)
    for g in np.argsort(-values, kind="stable")[:3]:
        free = ~done & (ga != g) & (gb != g)
        out[free] = values[g]
        done |= free
    return out


def greedy_swaps(x: np.ndarray, homes: np.ndarray, ea: np.ndarray, eb: np.ndarray, steps: int, num_gpus: int, model,
                 score: np.ndarray | None = None) -> np.ndarray:
    """Up to `steps` best swaps among pairs (ea, eb) on loads x, each pair once; adds each swap's saving to score[p]."""
    homes, free = homes.copy(), np.ones(ea.shape[0], bool)
    for _ in range(steps):
        cand = np.flatnonzero(free & (homes[ea] != homes[eb]))
        if not cand.size:
            break
        gain = swap_gains(x, homes, ea[cand], eb[cand], num_gpus, model)
        best = int(np.argmax(gain))
        if gain[best] <= 1e-15:
            break
        p = cand[best]
        homes[ea[p]], homes[eb[p]] = homes[eb[p]], homes[ea[p]]
        free[p] = False
        if score is not None:
            score[p] += gain[best]
    return homes


def candidate_pairs(x: np.ndarray, homes: np.ndarray, num_gpus: int, model) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of an expert on the GPU that sets the layer's time (busiest in work or in tokens) with any expert elsewhere."""
    tokens, work = gpu_work(x, homes, num_gpus, model)
    mine = np.flatnonzero(np.isin(homes, [int(np.argmax(work)), int(np.argmax(tokens))]))
    ea, eb = np.repeat(mine, homes.shape[0]), np.tile(np.arange(homes.shape[0]), mine.shape[0])
    keep = homes[ea] != homes[eb]
    return ea[keep], eb[keep]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--gpu", default="A6000x8")
    parser.add_argument("--iterations", type=int, default=300)
    parser.add_argument("--routing", default="flame-moe-290m")
    parser.add_argument("--geometry", default="deepseek-v2-lite")
    parser.add_argument("--pairs", type=int, default=8, help="swap pairs a layer holds in 5. (2 copies each)")
    args = parser.parse_args()
    loads, phase, profile, G = cell_loads(args.gpu, args.iterations, args.routing, args.geometry)
    model = profile.latency_model("host")
    I, L, E = loads.shape
    half = I // 2
    test, first = loads[half:], loads[:half]
    static = home_seconds(test, static_homes(E, G), G, model).mean(-1)  # [I - half]
    bound = np.asarray(profile_bound(test, G, profile)).mean(-1)
    ph = phase[half:]

    def share(seconds: np.ndarray, rows: np.ndarray | None = None) -> str:
        rows = np.ones(I - half, bool) if rows is None else rows
        return "  ".join(f"{p} {100 * (static[m].mean() - seconds[m].mean()) / (static[m].mean() - bound[m].mean()):.0f}%"
                         for p in PHASES for m in [(ph == p) & rows] if m.any())

    def on_homes(homes: np.ndarray) -> np.ndarray:
        return np.stack([home_seconds(test[:, l], homes[l], G, model) for l in range(L)], axis=1).mean(-1)

    print(f"{args.gpu}: {I} iterations, the second half's {I - half} scored; shares of the bound's gain (tokens and calls only)")
    past = fit(first, G, model)
    print(f"1. homes fitted on the first half:           {share(on_homes(past))}")
    print(f"2. hindsight homes (fitted on the second):   {share(on_homes(fit(test, G, model, 64)))}")
    odd = np.arange(I - half) % 2 == 1
    print(f"   fitted on its even, scored on its odd:    {share(on_homes(fit(test[~odd], G, model, 64)), odd)}")
    for window, every in ((64, 50), (64, 10), (32, 5), (16, 1)):
        seconds = np.empty(I - half)
        for i in range(half, I):
            if (i - half) % every == 0:
                homes = fit(loads[max(0, i - window):i], G, model)
            seconds[i - half] = np.mean([home_seconds(loads[i, l], homes[l], G, model) for l in range(L)])
        print(f"3. re-fitted every {every:>2} on the last {window:>2}:     {share(seconds)}")
    for steps in (2, 8):
        seconds = np.array([np.mean([home_seconds(x[l], greedy_swaps(x[l], past[l], *candidate_pairs(x[l], past[l], G, model),
                                                                     steps, G, model), G, model) for l in range(L)])
                            for x in test])
        print(f"4. per batch, {steps} swaps on its own loads ({2 * steps:>2} copies): {share(seconds)}")
    held, (ea, eb) = [], np.triu_indices(E, 1)
    for l in range(L):  # 5. pairs scored by the swaps the first half's last 64 batches would make
        score = np.zeros(ea.shape[0])
        for x in first[-64:, l]:
            greedy_swaps(x, past[l], ea, eb, 4, G, model, score)
        chosen, taken = [], set()
        for p in np.argsort(-score, kind="stable"):
            if len(chosen) == args.pairs or score[p] <= 0:
                break
            if ea[p] not in taken and eb[p] not in taken:
                chosen.append(p)
                taken |= {int(ea[p]), int(eb[p])}
        held.append((ea[chosen], eb[chosen]))
    seconds = np.array([np.mean([home_seconds(x[l], greedy_swaps(x[l], past[l], *held[l], args.pairs, G, model), G, model)
                                 for l in range(L)]) for x in test])
    print(f"5. {args.pairs} swap pairs held (+{200 * args.pairs / E:.0f}% replicas), swapped per batch: {share(seconds)}")


if __name__ == "__main__":
    main()
