"""Fine-tunes of a base MoE as ESFT makes them, on one pool four ways, in the twin: pure functions.

ESFT (Wang et al. 2024, "Let the Expert Stick to His Last", DeepSeek's method for DeepSeek-V2-Lite)
trains, per layer, the experts its task routes the most tokens to (ESFT-Token, by the token-selection
ratio; ESFT-Gate ranks by mean gate score instead) and freezes the router, attention and the other
experts. So a fine-tune here is:
- its task's routing: the frozen base router on the task's prompts. The twin has one measured
  routing per base and workload (evaluation/shared_pool_run.popularity); a task of its own is that
  routing with each layer's experts permuted, seeded per fine-tune: the same skew on other experts,
  as tasks route to different experts in ESFT's study;
- its replaced experts: round(share x L x E) of them, spread over the layers as evenly as whole
  experts allow (layer l gets round((l + 1) share E) - round(l share E): ESFT's counts per layer
  follow its task's data, which the twin does not have, so no layer is favoured), in each layer
  those its task routes the most tokens to (ESFT-Token; ties: the base's lower index, then permuted);
- the base's bytes everywhere else, non-expert weights included.

The four ways, every figure per fine-tune and for the pool: dedicated (a static-EP pool per
fine-tune), whole-model (one pool of whole models, no sharing), expert-grain (moeless's pool, each
fine-tune a model of its own: twin/shared_pool) and shared-keys (moeless's pool with experts addressed
by content: twin/shared_keys). Every shared pool here holds the GPUs its bytes take (at least G while
one computes), the whole-model pool too, though its models packed onto one GPU would share its compute.
The shared-keys pool's one engine batches every busy fine-tune's tokens in one step, so sized by bytes
it packs sixteen busy fine-tunes' compute onto the GPUs of one (the batched p99 shows it); beside it,
the same pool sized for that step too, by a step SLO per fine-tune (step_floor: each window at least
the GPUs that keep the batched step within the SLO of every fine-tune busy in it, or its own step
alone where that is longer; the SLO here is the fine-tune's p99 step on its dedicated pool, what it
had alone, so the pool meets that p99, not each window's step; held_for: an added GPU stays
step_hold_s after the last window that needed it; seen_late: a scaler step_lag_s late, whole windows
later, the rest within the window (added_gpus), where the default 0 is one inside the engine's step
loop; `gpu_s_sized_for_step`, p99 "shared-keys-batched-sized"). A window's added GPUs come with its
tokens, as the bytes' GPUs do here, the step's work spread evenly over them once they have copied
their share of the experts from the GPUs holding them (scaled_p99: the steps until then run on the
GPUs before; they copy the keys the window's calls route to, not every key held: SharedKeys.routed_keys,
from 2026-11-30; before, every key held). Or the engine holds a request that arrives while a scale-up is under way out of its
batch until the added GPUs take their part (gated admission, p99 "shared-keys-batched-gated", the sized pool's GPUs):
the steps until then carry the incumbents' part of the batch, the lesser of the window before's step
(what the GPUs before were sized for) and the window's own (a fine-tune not busy the window before has
no step before its wait: newcomer_windows), and the newcomers' waits are the price (admission_waits;
per fine-tune `scale_up_waits`: the share of its requests that wait and their p99, and its base-warm
wake-ups when a newcomer's wait falls on them (gated_wakes: wake "shared-keys-base-warm-gated"); a scaler whole
windows late gates nothing in the windows before it starts). The whole-model pool is not sized for
compute; beside it, `gpu_s_whole_model_own_gpus`: each awake whole model on GPUs of its own (its
bytes in whole GPUs, at least G), no two sharing a GPU's compute. A fine-tune's GPU-seconds in a
shared pool are the pool's in the ratio of its GB·s to the pool's.

Tiny example (the tests): with 0% replaced a fine-tune holds no key of its own, and with one
fine-tune the shared-keys pool is the expert-grain pool of that one model, figure for figure.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

import numpy as np

from moeless.twin.shared_pool import (
    WAYS,
    PoolModel,
    PoolSettings,
    Requests,
    evaluate_pool,
    stalled_p99,
    stats,
    steady_windows,
    timelines,
    weighted_p99,
)
from moeless.twin.shared_keys import SharedKeys, shared_keys_pass

SHARED_KEYS = "shared-keys"
ALL_WAYS = (*WAYS, SHARED_KEYS)
SIZED = "shared-keys-batched-sized"
GATED = "shared-keys-batched-gated"  # on the sized pool, newcomers waiting for a scale-up under way


@dataclass(frozen=True)
class FineTune:
    """One fine-tune: the base's sizes and load times with its task's routing (model.popularity),
    and the experts it replaced, replaced [L, E] bool."""

    model: PoolModel
    replaced: np.ndarray


def replaced_counts(layers: int, experts: int, share: float) -> np.ndarray:
    """[L] experts replaced per layer: round(share x L x E) in all, spread evenly (round half up)."""
    edges = np.floor(np.arange(layers + 1) * share * experts + 0.5).astype(np.int64)
    return np.diff(edges)


def make_finetune(base: PoolModel, name: str, routing: np.ndarray, share: float, rng: np.random.Generator) -> FineTune:
    """A fine-tune of `base` whose task routes as `routing` [L, E] (rows summing to 1) does on experts
    permuted per layer by `rng`, replacing `share` of the experts (the module docstring)."""
    if not 0 <= share < 1:
        raise ValueError(f"a fine-tune replaces a share of its base's experts in [0, 1), got {share:g}")
    layers, experts = routing.shape
    perm = np.stack([rng.permutation(experts) for _ in range(layers)])  # the task's expert perm[l, j] routes as j did
    popularity = np.zeros_like(routing)
    np.put_along_axis(popularity, perm, routing, axis=1)
    order = np.argsort(-routing, axis=1, kind="stable")  # the base routing's ranks, ties: the lower index
    replaced = np.zeros(routing.shape, bool)
    for layer, count in enumerate(replaced_counts(layers, experts, share)):
        replaced[layer, perm[layer, order[layer, :count]]] = True
    return FineTune(replace(base, name=name, popularity=popularity), replaced)


def step_floor(batched_step_s: np.ndarray, lines: list, slo_s: np.ndarray, gpus: int, s: PoolSettings) -> np.ndarray:
    """GPUs [W] the one engine needs for its batched step (batched_step_s [W] expert GPU seconds, every
    busy fine-tune's tokens), spread evenly over them, to take no longer for any fine-tune busy in the
    window than its step SLO (slo_s [N]; 0: none) or, where longer, its own step alone on G = `gpus`
    GPUs: ceil(the step / the least such limit); 0 where none is busy. So one fine-tune needs at most G."""
    steps = s.window_s / s.step_s
    busy = np.stack([line.busy for line in lines])
    alone = np.stack([line.compute_s for line in lines]) / (steps * gpus)
    each = np.maximum(slo_s[:, None], alone)
    limit = np.where(busy & (each > 0), each, np.inf).min(axis=0)  # a fine-tune with neither bounds nothing
    need = batched_step_s / np.where(np.isfinite(limit), limit, 1.0)
    return np.where(np.isfinite(limit), np.ceil(need * (1 - 1e-9) - 1e-9), 0.0)  # need = G exactly: G, not G + 1


def seen_late(floor: np.ndarray, windows: int) -> np.ndarray:
    """floor [W] GPUs as a scaler that sees each window's need `windows` windows later holds them."""
    return np.concatenate([np.zeros(min(windows, len(floor))), floor[:len(floor) - windows]]) if windows else floor


def held_for(floor: np.ndarray, windows: int) -> np.ndarray:
    """floor [W] GPUs, each kept `windows` more windows after the last that needed it (a scale-down
    delay: every scale-up copies experts onto the added GPUs, which the steps wait for)."""
    out = floor.copy()
    for lag in range(1, min(windows, len(floor) - 1) + 1):
        out[lag:] = np.maximum(out[lag:], floor[:-lag])
    return out


def steps_before(ready: np.ndarray, steps, step_len_s: float) -> np.ndarray:
    """[n] steps of each window (of `steps`) that start before its added GPUs take their part (ready [n, 2])."""
    return np.minimum(np.ceil(ready[:, 1] / step_len_s - 1e-9), steps)


def scaled_p99(step_s: np.ndarray, held: np.ndarray, ready: np.ndarray, cold: np.ndarray, steps: float,
               step_len_s: float, load_s: float, slow_step_s: np.ndarray | None = None) -> float:
    """The p99 step time of windows of `steps` steps (one count, or [n]; each step_len_s long) taking
    step_s [n] GPU seconds spread over held [n] GPUs, where ready [n, 2] (added_gpus: the GPUs before,
    the seconds the added ones load) keeps a window's first steps on the GPUs of the window before,
    carrying slow_step_s [n] GPU seconds (default step_s: every busy fine-tune's tokens; gated
    admission: the incumbents' part, its newcomers waiting for the scale-up), and each of its cold [n]
    cold starts stalls a step of its own by load_s (twin/shared_pool.stalled_p99), the window's other
    steps first, so that a later scale-up never shortens the p99."""
    slow_step_s = step_s if slow_step_s is None else slow_step_s
    slow = steps_before(ready, steps, step_len_s)
    stalled = np.minimum(cold, steps - slow)  # the cold starts stall the window's other steps first,
    stalled_slow = np.minimum(cold - stalled, slow)  # then those on the GPUs before
    before = np.maximum(ready[:, 0], 1.0)
    return weighted_p99(np.concatenate([step_s / held, step_s / held + load_s, slow_step_s / before,
                                        slow_step_s / before + load_s]),
                        np.concatenate([steps - slow - stalled, stalled, slow - stalled_slow, stalled_slow]))


def newcomer_windows(ready: np.ndarray, busy: np.ndarray, steps: float, step_len_s: float) -> tuple[np.ndarray, np.ndarray]:
    """One fine-tune's gated windows (busy [W], ready [W, 2]: added_gpus): where the pool grows and it was
    not busy the window before, it is a newcomer that waits for the added GPUs, so none of its steps runs
    on the GPUs before and it has only the window's steps after the wait: (ready [W, 2], steps [W])."""
    new = ~np.concatenate([[False], busy[:-1]]) & (ready[:, 1] > 0)
    after = np.where(new, steps - steps_before(ready, steps, step_len_s), steps)
    return np.where(new[:, None], ready * [1.0, 0.0], ready), after


def admission_waits(arrival: np.ndarray, ready: np.ndarray, window_s: float) -> np.ndarray:
    """[N] seconds each request (arrival [N] s, within the W windows) waits to join the engine's batch when
    newcomers wait for the scale-up under way (ready [W, 2]: added_gpus): a request arriving in a window
    whose added GPUs take ready[w, 1] s waits that long, as if its arrival had started the scale-up (a
    bound from above: one arriving later in the window waits less); elsewhere 0."""
    return ready[(arrival / window_s).astype(np.int64), 1]


def gated_wakes(wakes: np.ndarray, ready: np.ndarray) -> np.ndarray:
    """[n] seconds each wake-up (wakes [n, 3]: window, seconds, base warm; twin/shared_keys) takes to its
    first token when newcomers wait for the scale-up under way (ready [W, 2]: added_gpus): its own loads
    and that wait run side by side, so the longer of the two."""
    return np.maximum(wakes[:, 1], ready[wakes[:, 0].astype(np.int64), 1]) if len(wakes) else np.zeros(0)


def added_gpus(held: np.ndarray, keys: np.ndarray, move_s: float, late_s: float = 0.0, ask_s: float = 0.0,
               per_ask: int = 1) -> np.ndarray:
    """[W, 2]: for each window where the pool holds more GPUs (held [W]) than in the window before and
    had some then, those GPUs and the seconds until the added ones take their part: late_s (a scaler
    that sees the need that far into the window) plus their even share of the keys [W] the window's
    calls route to (keys / held each, copied from the GPUs that hold them, move_s an expert:
    PoolModel.expert_move_s, of which ask_s is its ask's fixed cost, one ask carrying per_ask experts:
    at least one ask, the holders' split ignored; a key held for a fine-tune not calling has no tokens
    to spread, so the planner places no copy of it); elsewhere (held, 0)."""
    prev = np.concatenate([[0.0], held[:-1]])
    grows = (prev > 0) & (held > prev)
    share = keys / np.maximum(held, 1.0)
    copy_s = late_s + share * (move_s - ask_s) + np.maximum(share / per_ask, np.minimum(share, 1.0)) * ask_s
    return np.stack([np.where(grows, prev, held), np.where(grows, copy_s, 0.0)], axis=1)


def shared_gpus(sk: SharedKeys, finetunes: list[FineTune], busy: np.ndarray, s: PoolSettings,
                extra: bool = False, floor: np.ndarray | None = None) -> np.ndarray:
    """GPUs [W] the shared-keys pool holds: its bytes in whole GPUs, at least G while one computes
    (twin/shared_pool.pool_gpus) and at least `floor` (step_floor: the batched step's GPUs, where the
    pool is sized for it); extra: with non-expert weights per fine-tune."""
    held = sk.held_bytes + (sk.extra_non_expert if extra else 0.0)
    gpus = np.maximum(np.ceil(held / s.gpu_bytes - 1e-9), np.where(busy, finetunes[0].model.gpus, 0)).astype(float)
    return gpus if floor is None else np.maximum(gpus, floor)


def evaluate_finetunes(finetunes: list[FineTune], requests: list[Requests], s: PoolSettings) -> dict:
    """Every way's figures for N fine-tunes of one base over the horizon (the module docstring)."""
    models = [ft.model for ft in finetunes]
    shapes = {ft.replaced.shape for ft in finetunes} | {m.popularity.shape for m in models}
    if len(shapes) != 1 or len({(m.expert_bytes, m.non_expert_bytes, m.gpus, m.top_k) for m in models}) != 1:
        raise ValueError("fine-tunes of one base share its geometry: layers, experts, bytes, GPUs and k")
    lines = timelines(models, requests, s)
    base = models[0]
    doc = evaluate_pool(models, requests, s, lines)
    sk = shared_keys_pass(models, np.stack([ft.replaced for ft in finetunes]), lines, s)
    busy = np.any([line.busy for line in lines], axis=0)
    gpus = shared_gpus(sk, finetunes, busy, s)
    slo = np.array([m["step_p99_s"]["dedicated"] for m in doc["models"]])  # each fine-tune's step SLO
    need = step_floor(sk.batched_step_s, lines, slo, base.gpus, s)
    lag_windows = int(s.step_lag_s / s.window_s + 1e-9)  # a lag within a window delays its added GPUs (added_gpus)
    floor = held_for(seen_late(need, lag_windows), int(round(s.step_hold_s / s.window_s)))
    sized = shared_gpus(sk, finetunes, busy, s, floor=floor)
    pool_gb_s = float(sk.held_bytes.sum() * s.window_s / 1e9)
    doc["gpu_s"][SHARED_KEYS] = float(gpus.sum() * s.window_s)
    doc["gpu_s_sized_for_step"] = float(sized.sum() * s.window_s)
    doc["gpu_s_own_non_expert"] = float(shared_gpus(sk, finetunes, busy, s, extra=True).sum() * s.window_s)
    # the whole-model pool with each awake model on GPUs of its own (paying for its compute)
    per_model = max(np.ceil(base.weight_bytes / s.gpu_bytes - 1e-9), base.gpus)
    doc["gpu_s_whole_model_own_gpus"] = float(sum(line.awake.sum() for line in lines) * per_model * s.window_s)
    doc["gb_s_shared_keys"] = pool_gb_s
    doc["gpu_s_ratio_to_dedicated"] = {way: v / doc["gpu_s"]["dedicated"] for way, v in doc["gpu_s"].items()}
    steps = s.window_s / s.step_s
    work = float(sk.batched_step_s.sum() * steps)  # the one engine's expert GPU seconds (a shared key's call once per step)
    doc["busy_fraction"][SHARED_KEYS] = work / doc["gpu_s"][SHARED_KEYS] if doc["gpu_s"][SHARED_KEYS] else 0.0
    doc["gpus_p50_p100"][SHARED_KEYS] = [float(np.percentile(gpus, 50)), float(gpus.max())]
    # an added GPU copies what the calls route to (held, since a call claims its keys), not every key held
    late_s = s.step_lag_s - lag_windows * s.window_s
    copied = base.expert_peer_s is not None  # from a peer GPU: asks, each at peer_copy_s (from host memory: loads)
    asks = (s.peer_copy_s if copied else 0.0, max(1, int(s.peer_batch_bytes // base.expert_bytes)) if copied else 1)
    ready = {way: added_gpus(held, sk.routed_keys, base.expert_move_s, late, *asks) for way, held, late in
             (("shared-keys-batched", gpus, 0.0), (SIZED, sized, late_s))}
    # gated: the steps on the GPUs before carry the incumbents' part, at most the window's own step (they
    # are some of its fine-tunes) and about the window before's (their running requests)
    before_step = np.minimum(np.concatenate([[0.0], sk.batched_step_s[:-1]]), sk.batched_step_s)
    for i, (ft, line, m) in enumerate(zip(finetunes, lines, doc["models"])):
        own, base_keys, non_expert = (float(x) for x in sk.gb_s[i])
        m["own_experts"] = int(ft.replaced.sum())
        m["gb_s"][SHARED_KEYS] = own + base_keys + non_expert
        m["gb_s_shared_keys_parts"] = {"own": own, "base": base_keys, "non-expert": non_expert}
        wakes = sk.wakes[i]
        m["wake_s"][SHARED_KEYS] = stats(wakes[:, 1])
        m["wake_s"]["shared-keys-base-warm"] = stats(wakes[wakes[:, 2] > 0, 1])
        m["wake_s"]["shared-keys-base-warm-gated"] = stats(gated_wakes(wakes[wakes[:, 2] > 0], ready[SIZED]))
        m["whole_load_s"] = ft.model.whole_load_s
        m["cold_starts_outside_wakes_shared_keys"] = int(sk.cold_starts[i].sum())
        windows = steady_windows(line)
        alone = line.compute_s[windows] / (steps * ft.model.gpus)
        m["step_p99_s"][SHARED_KEYS] = stalled_p99(alone, sk.cold_starts[i][windows], steps, ft.model.expert_load_s)
        for way, held in (("shared-keys-batched", gpus), (SIZED, sized)):
            m["step_p99_s"][way] = scaled_p99(sk.batched_step_s[windows], held[windows], ready[way][windows],
                                              sk.cold_starts[i][windows], steps, s.step_s, ft.model.expert_load_s)
        gated, its_steps = newcomer_windows(ready[SIZED], line.busy, steps, s.step_s)
        m["step_p99_s"][GATED] = scaled_p99(sk.batched_step_s[windows], sized[windows], gated[windows],
                                            sk.cold_starts[i][windows], its_steps[windows], s.step_s,
                                            ft.model.expert_load_s, slow_step_s=before_step[windows])
        arrival = requests[i].arrival
        waits = admission_waits(arrival[arrival < s.horizon_s], ready[SIZED], s.window_s)  # the requests counted
        m["scale_up_waits"] = {"waited": float((waits > 0).mean()) if len(waits) else 0.0, **stats(waits[waits > 0])}
    for way in ALL_WAYS:  # each fine-tune's GPU-seconds: the pool's in the ratio of its GB·s
        total = sum(m["gb_s"][way] for m in doc["models"])
        for m in doc["models"]:
            m.setdefault("gpu_s", {})[way] = (m["dedicated_gpus"] * s.horizon_s if way == "dedicated"
                                              else doc["gpu_s"][way] * m["gb_s"][way] / total if total else 0.0)
    return doc

