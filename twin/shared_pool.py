"""Several models on one pool of GPUs, three ways, in the twin: pure functions over arrays.

The three ways (docs/shared-pool.md):
- dedicated: each model its own static-EP pool of G_m GPUs, held all the time;
- whole-model: one pool shared at the grain of whole models, as platforms that serve many models
  do today: an awake model holds all its weights, a model idle for `idle_delay_s` gives all of
  them back, and its next request waits for the whole model to load again;
- expert-grain (moeless): one pool shared at the grain of experts: an awake model holds its
  non-expert weights and the experts that got a token within `keep_alive_s`; asleep (idle for
  `idle_delay_s`) it holds nothing; a wake-up loads the non-expert weights and, layer by layer,
  the experts its first window routes to (the wake's time), and then the rest of its experts behind
  them, as moeless's planning loop prefetches its static share on its first pass (held, and billed,
  until the keep-alive evicts those that get no token); an expert evicted while its model is awake
  and then routed to again is a cold start outside a wake-up (its load time exposed, not hidden).
  With `keep_warm` > 0 a model keeps that share of each layer's experts, its most popular, resident
  all the time (asleep too, billed): a wake-up loads only the routed experts outside that set.

In numbered steps, per model (windows of window_s over horizon_s):
1. Tokens per window from the requests (arrival, prompt, output): the prompt in the window it
   arrives, then one token per step_s while it decodes; a window is busy while a request runs.
2. Awake windows: busy, or busy within the last idle_delay_s.
3. Expert hits per window: expert e of layer l gets a token with probability
   1 - exp(-tokens * k * popularity[l, e]) (popularity: the routing's share of each layer's pairs),
   drawn with a seeded generator; resident: awake and hit within keep_alive_s.
4. Memory per window and way; wake-ups (a request at a sleeping model) and their load times.
Then the pool: GPUs held per window = max(ceil(bytes held / a GPU's usable bytes), the largest
G_m of the models serving a request) for the shared ways (a model computing spreads over as many
GPUs as its dedicated pool, so its MoE layer runs on as many GPUs as there), G_m per model for the
dedicated.

Per model, the p99 over decode steps outside wake-ups of its MoE time per step (step_time_p99): its
experts' compute of each busy window spread evenly over its G GPUs and steps; in the expert-grain
pool each cold start outside a wake-up stalls a step of its window by one expert's load (each its
own step: the most steps slowed). The same in both other ways, without the stalls. Beside it, each
shared pool's p99 with the models' calls meeting on its GPUs (shared_gpu_p99, "<way>-shared-gpus"):
a step no shorter than alone, nor than every busy model's expert work of its window spread evenly over
the pool's GPUs (calls that meet queue behind one another), with the same stalls.

Not modelled: which GPUs two models' calls meet on (the figure above spreads them evenly), bin-packing losses
(both shared pools pack bytes perfectly, which favours the whole-model pool), replicas of
stragglers (moeless holds one replica per hot expert here, as static EP does).

Tiny example (the golden test): one model, 2 layers x 2 experts of 1 GB, 1 GB non-expert, G = 1 on
a GPU of 8 usable GB, one request at t = 0 (4 prompt tokens, 2 output, step 1 s: it runs in windows
0-1), windows of 1 s, horizon 10 s, idle delay 3 s: awake in windows 0-4; the dedicated pool holds
10 GPU-seconds, each shared pool 5; one wake-up, whole-model 1 + 4 x 1 = 5 s with loads of 1 s.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from moeless.twin.roofline import PEER_COPY_S

WAYS = ("dedicated", "whole-model", "expert-grain")


@dataclass(frozen=True)
class PoolModel:
    """One model: geometry facts in bytes, its dedicated GPU count, load times from the host tier,
    popularity [L, E] (each row sums to 1)."""

    name: str
    top_k: int
    expert_bytes: int
    non_expert_bytes: int
    gpus: int
    expert_load_s: float  # one expert from host memory to a GPU (a cold start)
    non_expert_load_s: float  # the non-expert weights, likewise
    alpha_s: float  # expert compute per (token, expert) pair on one GPU
    call_s: float  # one expert call's fixed cost (its weights read from GPU memory)
    popularity: np.ndarray
    expert_peer_s: float | None = None  # one expert copied from a GPU of the pool holding it (None: from host)

    @property
    def expert_move_s(self) -> float:
        """One resident expert moved onto another GPU of the pool: a peer copy, else a host load."""
        return self.expert_load_s if self.expert_peer_s is None else self.expert_peer_s

    @property
    def layers(self) -> int:
        return int(self.popularity.shape[0])

    @property
    def experts(self) -> int:
        return int(self.popularity.shape[1])

    @property
    def weight_bytes(self) -> int:
        return self.non_expert_bytes + self.layers * self.experts * self.expert_bytes

    @property
    def whole_load_s(self) -> float:
        """A whole-model wake-up: every expert, G loads in parallel, then the non-expert weights."""
        return self.non_expert_load_s + math.ceil(self.layers * self.experts / self.gpus) * self.expert_load_s


@dataclass(frozen=True)
class Requests:
    """arrival [N] seconds (non-decreasing), prompt [N] and output [N] tokens."""

    arrival: np.ndarray
    prompt: np.ndarray
    output: np.ndarray


@dataclass(frozen=True)
class PoolSettings:
    horizon_s: float = 3600.0
    window_s: float = 1.0
    step_s: float = 0.05  # one decode iteration
    idle_delay_s: float = 60.0  # a model with no request this long sleeps (both shared ways)
    keep_alive_s: float = 60.0  # an expert without a token this long is evicted (expert-grain)
    gpu_bytes: float = 64e9  # a GPU's bytes for weights
    seed: int = 0
    keep_warm: float = 0.0  # share of each layer's experts (the most popular) kept resident while asleep
    family_warm: bool = True  # shared keys: the base's held experts stay while any fine-tune of it is awake
    step_hold_s: float = 2.0  # shared keys, pool sized for its step: a GPU added for the step stays this long unneeded
    step_lag_s: float = 0.0  # ... and its scaler sees a window's need this late (0: a scaler in the engine's step loop)
    scale_up_copies: str = "peer"  # ... and its added GPUs copy their keys from a GPU holding them, or load them ("host")
    peer_copy_s: float = PEER_COPY_S  # ... each copy's fixed cost on the expert host beside its bytes (roofline.py)
    peer_batch_bytes: float = 0.0  # ... paid once an ask of replicas that fit these bytes (0: one ask a replica)

    @property
    def windows(self) -> int:
        return int(math.ceil(self.horizon_s / self.window_s))


def window_tokens(requests: Requests, s: PoolSettings) -> tuple[np.ndarray, np.ndarray]:
    """Step 1: (tokens [W] float, busy [W] bool) of one model's requests."""
    w = s.windows
    tokens, busy = np.zeros(w), np.zeros(w + 1)
    start = np.floor(requests.arrival / s.window_s).astype(np.int64)
    # The last window a request runs in (one that ends on a window's edge does not run in the next).
    end = np.maximum(np.ceil((requests.arrival + requests.output * s.step_s) / s.window_s).astype(np.int64) - 1, start)
    keep = start < w
    np.add.at(tokens, start[keep], requests.prompt[keep])
    # Decode tokens spread evenly over the windows the request decodes in (a difference array).
    rate = np.zeros(w + 1)
    span = (end - start + 1)[keep]
    np.add.at(rate, start[keep], requests.output[keep] / span)
    np.add.at(rate, np.minimum(end[keep] + 1, w), -requests.output[keep] / span)
    np.add.at(busy, start[keep], 1)
    np.add.at(busy, np.minimum(end[keep] + 1, w), -1)
    return tokens + np.cumsum(rate)[:w], np.cumsum(busy)[:w] > 0.5


def awake_windows(busy: np.ndarray, delay_windows: int) -> np.ndarray:
    """Step 2: [W] bool, busy now or idle for at most delay_windows since."""
    last = np.where(busy, np.arange(len(busy)), -10**9)
    return np.arange(len(busy)) - np.maximum.accumulate(last) <= delay_windows


@dataclass(frozen=True)
class ModelTimeline:
    """One model's windows: tokens, busy (a request running), awake, resident experts
    (expert-grain), cold starts outside wake-ups, its wake-ups (window, whole-model seconds,
    expert-grain seconds), and its experts' GPU time per window (every step's calls)."""

    tokens: np.ndarray
    busy: np.ndarray
    awake: np.ndarray
    resident: np.ndarray
    cold_starts: np.ndarray
    wake_windows: np.ndarray
    wake_whole_s: np.ndarray
    wake_expert_s: np.ndarray
    compute_s: np.ndarray
    warm_experts: int = 0  # experts kept resident while asleep (expert-grain)
    hits: np.ndarray | None = field(default=None, repr=False)  # [awake windows, L, E] bool: the experts each routed to


def warm_mask(popularity: np.ndarray, share: float) -> np.ndarray:
    """[L, E] bool: each layer's ceil(share x E) most popular experts (ties: the lower index)."""
    keep = int(math.ceil(share * popularity.shape[1] - 1e-9))
    order = np.argsort(-popularity, axis=1, kind="stable")[:, :keep]
    mask = np.zeros(popularity.shape, bool)
    np.put_along_axis(mask, order, True, axis=1)
    return mask


def expert_seconds(model: PoolModel, tokens: np.ndarray, busy: np.ndarray, s: "PoolSettings") -> np.ndarray:
    """GPU seconds [W] the model's experts compute: per decode step (window_s / step_s of them while
    busy) every expert routed a token pays its call, and every pair alpha."""
    steps = np.where(busy, s.window_s / s.step_s, 0.0)
    per_step = np.divide(tokens, steps, out=np.zeros_like(tokens), where=steps > 0)
    hit = -np.expm1(-per_step[:, None] * model.top_k * model.popularity.reshape(1, -1)).sum(axis=1)
    return steps * hit * model.call_s + tokens * model.top_k * model.alpha_s


def timeline(model: PoolModel, requests: Requests, s: PoolSettings, rng: np.random.Generator) -> ModelTimeline:
    """Steps 1-3 and the wake-ups of one model."""
    tokens, busy = window_tokens(requests, s)
    awake = awake_windows(busy, int(round(s.idle_delay_s / s.window_s)))
    keep = int(round(s.keep_alive_s / s.window_s))
    last_hit = np.full(model.popularity.shape, -10**9)
    kept = warm_mask(model.popularity, s.keep_warm)  # resident all along
    resident, cold = np.zeros(s.windows, np.int64), np.zeros(s.windows, np.int64)
    wakes, wake_expert = [], []
    # Every awake window's draws at once (the same stream as one draw per window), kept: the fine-tunes'
    # shared keys (twin/shared_keys.py) replay the very experts each model routed to here.
    windows = np.flatnonzero(awake)
    hits = rng.random((len(windows), *model.popularity.shape)) < -np.expm1(
        -tokens[windows, None, None] * model.top_k * model.popularity)
    for w, hit in zip(windows, hits):
        waking = w == 0 or not awake[w - 1]
        warm = ((w - last_hit <= keep) & ~waking) | kept  # a wake-up finds only the keep-warm set resident
        if waking:
            wakes.append(w)
            per_layer = np.ceil((hit & ~kept).sum(axis=1) / model.gpus)  # each layer's experts, G loads at once
            wake_expert.append(model.non_expert_load_s + per_layer.sum() * model.expert_load_s)
            last_hit[:] = w  # the rest load behind the routed ones (the loop's first pass: its static share)
        else:
            cold[w] = int((hit & ~warm).sum())
        last_hit[hit] = w
        resident[w] = int(((w - last_hit <= keep) | kept).sum())
    wake_windows = np.asarray(wakes, np.int64)
    return ModelTimeline(tokens, busy, awake, resident, cold, wake_windows, np.full(len(wakes), model.whole_load_s),
                         np.asarray(wake_expert, float), expert_seconds(model, tokens, busy, s), int(kept.sum()), hits)


def steady_windows(line: ModelTimeline) -> np.ndarray:
    """The busy windows outside the model's wake-ups (those its p99 per step counts)."""
    windows = np.flatnonzero(line.busy)
    return windows[~np.isin(windows, line.wake_windows)]


def step_time_p99(model: PoolModel, line: ModelTimeline, s: PoolSettings) -> dict[str, float]:
    """p99 MoE seconds per decode step outside wake-ups, each way (the module docstring); 0.0 when
    the model never computed outside a wake-up."""
    windows = steady_windows(line)
    steps = s.window_s / s.step_s
    base = line.compute_s[windows] / (steps * model.gpus)
    plain = weighted_p99(base, np.full(len(base), steps))
    grain = stalled_p99(base, line.cold_starts[windows], steps, model.expert_load_s)
    return {"dedicated": plain, "whole-model": plain, "expert-grain": grain}


def shared_gpu_p99(model: PoolModel, line: ModelTimeline, pool_work_s: np.ndarray, pool_gpus: np.ndarray,
                   s: PoolSettings, stalls: bool) -> float:
    """p99 MoE seconds per step outside wake-ups with every model's calls on the pool's GPUs: each
    steady window's step the longer of the model's own work over its G GPUs and the pool's expert work
    of the window (pool_work_s [W] GPU seconds, every model's) over pool_gpus [W]; stalls: its cold
    starts stall steps as in step_time_p99."""
    windows = steady_windows(line)
    steps = s.window_s / s.step_s
    alone = line.compute_s[windows] / (steps * model.gpus)
    step = np.maximum(alone, pool_work_s[windows] / (steps * np.maximum(pool_gpus[windows], 1.0)))
    cold = line.cold_starts[windows] if stalls else np.zeros(len(windows))
    return stalled_p99(step, cold, steps, model.expert_load_s)


def stalled_p99(base: np.ndarray, cold: np.ndarray, steps: float, load_s: float) -> float:
    """The p99 step time of windows of `steps` steps each taking `base` [n] seconds, where each of a
    window's `cold` [n] cold starts stalls a step of its own by load_s."""
    stalled = np.minimum(cold, steps)
    return weighted_p99(np.concatenate([base, base + load_s]), np.concatenate([steps - stalled, stalled]))


def weighted_p99(values: np.ndarray, weights: np.ndarray) -> float:
    """The 99th percentile of `values`, each counted `weights` times (the lowest value at or above 99%)."""
    keep = weights > 0
    if not keep.any():
        return 0.0
    order = np.argsort(values[keep], kind="stable")
    cum = np.cumsum(weights[keep][order])
    return float(values[keep][order][np.searchsorted(cum, 0.99 * cum[-1])])


def held_bytes(model: PoolModel, line: ModelTimeline) -> dict[str, np.ndarray]:
    """Step 4: bytes [W] each way holds for this model (dedicated: its G GPUs' weights all along)."""
    w = len(line.awake)
    return {"dedicated": np.full(w, float(model.weight_bytes)),
            "whole-model": np.where(line.awake, float(model.weight_bytes), 0.0),
            "expert-grain": np.where(line.awake, model.non_expert_bytes + line.resident * float(model.expert_bytes),
                                     line.warm_experts * float(model.expert_bytes))}


def pool_gpus(models: list[PoolModel], lines: list[ModelTimeline], held: list[dict[str, np.ndarray]],
              s: PoolSettings) -> dict[str, np.ndarray]:
    """GPUs [W] each way holds: the dedicated pools' sum; a shared pool's bytes in whole GPUs, at
    least the largest G of the models serving a request."""
    out = {"dedicated": np.full(s.windows, float(sum(m.gpus for m in models)))}
    floor = np.max([np.where(line.busy, m.gpus, 0) for m, line in zip(models, lines)], axis=0)
    for way in WAYS[1:]:
        total = np.sum([h[way] for h in held], axis=0)
        out[way] = np.maximum(np.ceil(total / s.gpu_bytes - 1e-9), floor).astype(float)
    return out


def timelines(models: list[PoolModel], requests: list[Requests], s: PoolSettings) -> list[ModelTimeline]:
    """Steps 1-3 for every model, in order, from one generator seeded with s.seed."""
    if len(models) != len(requests) or not models:
        raise ValueError(f"need one request list per model, got {len(models)} models and {len(requests)} lists")
    rng = np.random.default_rng(s.seed)
    return [timeline(m, r, s, rng) for m, r in zip(models, requests)]


def evaluate_pool(models: list[PoolModel], requests: list[Requests], s: PoolSettings,
                  lines: list[ModelTimeline] | None = None) -> dict:
    """Every way's figures for these models over the horizon (see the module docstring); `lines`:
    their timelines when the caller has them already."""
    lines = lines if lines is not None else timelines(models, requests, s)
    held = [held_bytes(m, line) for m, line in zip(models, lines)]
    gpus = pool_gpus(models, lines, held, s)
    compute_s = sum(float(line.compute_s.sum()) for line in lines)
    per_model = []
    for m, r, line, h in zip(models, requests, lines, held):
        per_model.append({
            "model": m.name, "dedicated_gpus": m.gpus, "weight_gb": m.weight_bytes / 1e9,
            "requests": int((r.arrival < s.horizon_s).sum()),
            "idle_fraction": float(1 - line.awake.mean()),
            "gb_s": {way: float(h[way].sum() * s.window_s / 1e9) for way in WAYS},
            "wake_ups": int(len(line.wake_windows)),
            "wake_s": {way: stats(x) for way, x in (("whole-model", line.wake_whole_s), ("expert-grain", line.wake_expert_s))},
            "cold_starts_outside_wakes": int(line.cold_starts.sum()),
            "cold_start_s_outside_wakes": float(line.cold_starts.sum() * m.expert_load_s),
            "mean_resident_experts_awake": float(line.resident[line.awake].mean()) if line.awake.any() else 0.0,
            "step_p99_s": step_time_p99(m, line, s),
        })
    work = np.sum([line.compute_s for line in lines], axis=0)  # the pool's expert GPU seconds per window
    for m, line, row in zip(models, lines, per_model):
        for way in WAYS[1:]:
            row["step_p99_s"][f"{way}-shared-gpus"] = shared_gpu_p99(m, line, work, gpus[way], s, way == "expert-grain")
    gpu_s = {way: float(g.sum() * s.window_s) for way, g in gpus.items()}
    return {"gpu_s": gpu_s, "gpu_s_ratio_to_dedicated": {way: v / gpu_s["dedicated"] for way, v in gpu_s.items()},
            "busy_fraction": {way: compute_s / v if v else 0.0 for way, v in gpu_s.items()},
            "gpus_p50_p100": {way: [float(np.percentile(g, 50)), float(g.max())] for way, g in gpus.items()},
            "models": per_model}


def stats(x: np.ndarray) -> dict:
    """count, p50 and p99 of wake-up seconds x [n] (None without one)."""
    return {"count": int(len(x)), "p50": float(np.percentile(x, 50)) if len(x) else None,
            "p99": float(np.percentile(x, 99)) if len(x) else None}
