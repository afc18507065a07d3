"""Where each expert's home may be, as pure functions over loads (placement/home_moves.py's steps 2
and 3): EPLB's packing of summed loads with no redundant expert, best swaps of two experts on the
kept iterations, the time of a layer with every token at its home, and the choice of how many
kept iterations a chance fits on.

Golden example: `packed_homes([[10, 1, 1, 10, 5, 5, 1, 1]], 2)` puts the two experts of 10 apart,
17 tokens on each GPU (static EP's blocks hold 22 and 12).
"""

from __future__ import annotations

import numpy as np

from moeless.placement.eplb import rebalance_experts
from moeless.placement.latency_model import LatencyModel

WINDOWS = (64, 256)  # the last iterations a chance's swaps and judge may weigh (~3 s and ~13 s at 50 ms an
# iteration), one chosen at each chance (step 2): a steady mixture is fitted better by the long one, drifting prompts by the short
WINDOW_MEMORY = 0.9  # a window's score at a chance: its candidates' seconds since, plus this times its score before
FIT_SAMPLES = 64  # iterations a window's swaps weigh at most, evenly spaced over it (their time grows with them)
SWAPS = 16  # best swaps tried on the packing per layer and chance (a bound on the time; a layer stops where none helps)
MAX_PAIRS = 8192  # swaps weighed per step: all pairs up to E = 128; beyond, those with an expert of the busiest GPUs
# (a chance's swaps, timed on 2 cores: 0.1 s a layer at E = 64 on 8 GPUs, 0.8 s at E = 256 on 64)


def static_homes(num_experts: int, num_gpus: int) -> np.ndarray:
    """[E] static EP's blocks: expert e on GPU e * G // E."""
    return np.arange(num_experts) * num_gpus // num_experts


def packed_homes(loads: np.ndarray, num_gpus: int) -> np.ndarray:
    """[L, E] summed loads -> [L, E] home GPUs: EPLB's packing with no redundant expert (E slots
    rounded up to a multiple of G; an expert given two slots lives at its first)."""
    num_layers, num_experts = loads.shape
    slots = -(-num_experts // num_gpus) * num_gpus
    phy2log, _, _ = rebalance_experts(np.asarray(loads, dtype=np.float64), slots, 1, 1, num_gpus)
    homes = np.empty((num_layers, num_experts), np.int64)
    for l in range(num_layers):
        first = np.unique(np.asarray(phy2log[l]), return_index=True)[1]
        homes[l] = first // (slots // num_gpus)
    return homes


def swapped_homes(samples: np.ndarray, homes: np.ndarray, num_gpus: int, model: LatencyModel,
                  swaps: int = SWAPS) -> np.ndarray:
    """Step 2's swaps: samples [S, E] tokens, homes [E] -> [E] homes after at most `swaps` best swaps
    of two experts on different GPUs, each lowering the mean over samples of the busiest GPU's share
    of the sample's work without raising the mean of its seconds (stops where none does)."""
    tokens = np.rint(samples)
    seconds = model.alpha * tokens + model.call_overhead * (tokens > 0)  # [S, E]
    shares = seconds / np.maximum(seconds.sum(axis=1, keepdims=True), 1e-30)  # [S, E]: each sample's work is 1
    homes = np.asarray(homes, dtype=np.int64).copy()
    num_experts = homes.shape[0]
    a, b = np.triu_indices(num_experts, 1)
    few = a.shape[0] <= MAX_PAIRS
    for _ in range(swaps):
        if not few:  # the experts of the busiest GPUs (on average), each with every other
            busiest = np.argsort(-(shares @ np.eye(num_gpus)[homes]).mean(axis=0), kind="stable")
            mine = np.concatenate([np.flatnonzero(homes == g) for g in busiest])[:max(1, MAX_PAIRS // num_experts)]
            a, b = np.repeat(mine, num_experts), np.tile(np.arange(num_experts), mine.shape[0])
        pair = homes[a] != homes[b]
        ea, eb = a[pair], b[pair]
        if not ea.size:
            break
        now, after = _busiest_after_swaps(shares, homes, ea, eb, num_gpus)
        better = np.flatnonzero(after < now * (1.0 - 1e-9))
        now_s, after_s = _busiest_after_swaps(seconds, homes, ea[better], eb[better], num_gpus)
        better = better[after_s <= now_s * (1.0 + 1e-9)]  # the window's busiest seconds: no worse
        if not better.size:
            break
        best = better[np.argmin(after[better])]
        homes[ea[best]], homes[eb[best]] = homes[eb[best]], homes[ea[best]]
    return homes


def _busiest_after_swaps(work: np.ndarray, homes: np.ndarray, ea: np.ndarray, eb: np.ndarray,
                         num_gpus: int) -> tuple[float, np.ndarray]:
    """work [S, E], homes [E], pairs ea, eb [P] on different GPUs -> (the mean over samples of the
    busiest GPU's work now, [P] the same after swapping each pair's homes)."""
    per_gpu = work @ np.eye(num_gpus)[homes]  # [S, G]
    ga, gb = homes[ea], homes[eb]
    # the busiest GPU other than ga and gb, per sample: the first of its three busiest that is neither
    top = np.argsort(-per_gpu, axis=1)[:, :3]  # [S, <=3]
    other, taken = np.zeros((ea.shape[0], work.shape[0])), np.zeros((ea.shape[0], work.shape[0]), bool)
    for j in range(top.shape[1]):
        free = ~taken & (top[None, :, j] != ga[:, None]) & (top[None, :, j] != gb[:, None])
        other = np.where(free, np.take_along_axis(per_gpu, top[:, j:j + 1], 1)[None, :, 0], other)
        taken |= free
    moved = (work[:, eb] - work[:, ea]).T  # [P, S]: what ga gains and gb loses
    after = np.maximum(other, np.maximum(per_gpu[:, ga].T + moved, per_gpu[:, gb].T - moved)).mean(axis=1)
    return float(per_gpu.max(axis=1).mean()), after


def home_time(samples: np.ndarray, homes: np.ndarray, num_gpus: int, model: LatencyModel) -> float:
    """Mean seconds of a layer over samples [S, E] of tokens with every token at its home [E] (`home_seconds`)."""
    return float(home_seconds(samples, homes, num_gpus, model).mean())


def home_seconds(loads: np.ndarray, homes: np.ndarray, num_gpus: int, model: LatencyModel) -> np.ndarray:
    """Seconds of a layer per load [..., E] of tokens with every token at its home [E] -> [...]: the
    busiest GPU's alpha * tokens + call_overhead per expert with tokens, plus 2 beta times the
    most tokens a GPU receives (kernels.serial_time's model, all loads at once)."""
    tokens, work = gpu_work(loads, homes, num_gpus, model)
    return work.max(axis=-1) + 2.0 * model.beta * tokens.max(axis=-1)


def gpu_work(loads: np.ndarray, homes: np.ndarray, num_gpus: int, model: LatencyModel) -> tuple[np.ndarray, np.ndarray]:
    """(tokens [..., G], work [..., G]) on each GPU with loads [..., E] at their homes [E]: alpha *
    tokens + call_overhead per expert with tokens (`home_seconds`' terms, before their maxima)."""
    onehot = np.zeros((homes.shape[0], num_gpus))
    onehot[np.arange(homes.shape[0]), homes] = 1.0
    tokens = np.rint(loads) @ onehot
    return tokens, model.alpha * tokens + model.call_overhead * ((np.rint(loads) > 0) @ onehot)


def candidate_homes(sums: np.ndarray, samples: np.ndarray, num_gpus: int, model: LatencyModel,
                    windows: tuple[int, ...] = WINDOWS) -> dict[int, np.ndarray]:
    """Step 2: summed loads [L, E] and kept samples [L, S, E] -> {window: the candidate homes [L, E]
    swapped on the last `window` samples, at most FIT_SAMPLES of them evenly spaced, the newest
    among them} (windows of S or more share one candidate)."""
    packed = packed_homes(sums, num_gpus)
    fitted: dict[int, np.ndarray] = {}
    for n in sorted({min(w, samples.shape[1]) for w in windows}):
        weighed = samples[:, samples.shape[1] - 1 - np.arange(0, n, -(-n // FIT_SAMPLES))[::-1]]  # the newest first kept
        fitted[n] = np.stack([swapped_homes(weighed[l], packed[l], num_gpus, model) for l in range(sums.shape[0])])
    return {w: fitted[min(w, samples.shape[1])] for w in windows}


def window_seconds(tried: dict[int, np.ndarray], since: np.ndarray, num_gpus: int,
                   model: LatencyModel) -> dict[int, float]:
    """Each window's last candidate (tried: {window: homes [L, E]}) timed on loads it never saw
    (since: [L, S, E], the iterations after it was fitted): its layers' mean seconds, summed."""
    return {w: sum(home_time(since[l], homes[l], num_gpus, model) for l in range(since.shape[0]))
            for w, homes in tried.items()}


def chosen_window(scores: dict[int, float], current: int) -> int:
    """Step 2's choice: the window of the least score (its candidates' seconds on later loads,
    `window_seconds`, WINDOW_MEMORY-decayed over the chances), the current one on a tie, else the shorter.

    >>> chosen_window({64: 18.0, 256: 10.0}, 64), chosen_window({64: 10.0, 256: 10.0}, 256)
    (256, 256)
    """
    return min(scores, key=lambda w: (scores[w], w != current, w))
