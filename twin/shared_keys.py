"""Fine-tunes of one base on one pool whose experts are addressed by content (shared keys), in the
twin: pure functions over arrays (docs/shared-pool.md, "Many fine-tunes of one base").

A key is one expert's bytes: the base's expert (l, e) is key l x E + e, and each fine-tune's
replaced experts are keys of their own after the base's (twin/finetunes.py). The pool holds one
replica per key, whichever fine-tunes route to it, and the non-expert weights once: ESFT freezes
them, so every fine-tune of a base has the same bytes there, and one engine serves them all (tokens
of every fine-tune in one batch, each routed to its own keys; ExpertWeave's design, issue 44 item 3).

Each fine-tune's windows, wake-ups and routed experts are its twin/shared_pool timeline's (the same
draws as the expert-grain way, where it is a model of its own). Per window, in numbered steps:
1. Resident before the window's calls: every key claimed by a fine-tune awake and not waking (it
   routed a token to the key within keep_alive_s, or its wake-up prefetched the key that long ago),
   the keep-warm sets, and (family_warm, the hosts' rule: expert_fn/host/model_calls.py) every
   base key held in the last window that a fine-tune not calling uses, while a fine-tune stays
   awake: the base's replicas outlive their keep-alive while any fine-tune of it calls, so a
   fine-tune waking then finds the base's experts held (those its awake siblings replaced or have
   not routed to lately) and loads only its own.
2. Each awake fine-tune's calls: a routed key not resident is a cold start, outside a wake-up, or
   part of its wake-up. A wake-up loads at once, at its first call, each of its keys not resident
   where another fine-tune's key of the same (layer, expert) is (the expert hosts' wake set:
   ModelStores.wake_set; a family engine places every member's expert where the base's is), spread
   over the pool's GPUs (a PCIe link each: the GPUs its bytes take in the window, at least G); the
   routed keys not so placed load layer by layer, G at once, as the expert-grain way loads, before
   the wake set's (a call's loads go first on the hosts), and so do routed keys of the wake set not
   loaded yet when the forward reaches their layer (`wake_seconds`); the non-expert weights too unless
   another fine-tune awake holds them. A wake-up then claims all the fine-tune's keys (the loop
   prefetches its static share); every routed key is claimed anew.
3. Held after the calls: the union of the claims, and with family_warm, of the base keys a
   fine-tune asleep uses (it may wake), those held before while any fine-tune is awake and the one
   at each place where a fine-tune holds its own (the expert it replaced: a host loads it ahead,
   into free memory, once the own one is resident; the fine-tune claims it while it holds its own);
   the non-expert weights while any fine-tune is awake.
4. GB·s split, by the hosts' rule (expert_fn/host/meters.py; docs/shared-pool.md, "Who pays for a
   shared replica") at the window's grain: each window, a held key's GB·s (its bytes x window_s) is
   split evenly among the fine-tunes claiming it in that window (step 3's claims); a held window
   nobody claims (a key family_warm keeps) goes to those that claimed it last in its residency. A
   replaced expert's key is its fine-tune's alone; the non-expert weights split evenly among the
   fine-tunes awake in the window. So the fine-tunes' GB·s add up to the pool's. Why per
   moment: a fine-tune pays for the windows its use keeps a replica resident and stops paying when its
   claim runs out, whoever else keeps it (the host meters each moment; a window is the twin's
   moment). Why evenly, not by tokens: docs/shared-pool.md argues it.

The MoE time per step, two ways: alone (the house figure, twin/shared_pool.step_time_p99: the
fine-tune's own compute over G GPUs, its cold starts as stalls) and batched: the engine's step
carries the tokens of every fine-tune busy in the window, so a key routed by several is one call
with all their tokens; the step's work spread evenly over the GPUs the pool holds in the window (at
least G: the bound, as every way's step in this twin), with the fine-tune's own stalls.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeless.twin.shared_pool import ModelTimeline, PoolModel, PoolSettings, warm_mask


@dataclass(frozen=True)
class SharedKeys:
    """The pool with shared keys, window by window, and each fine-tune's share of it.

    held_bytes [W]: bytes held; extra_non_expert [W]: the bytes more if each awake fine-tune held
    non-expert weights of its own (one engine per fine-tune instead of one for all); gb_s [N, 3]: each
    fine-tune's GB·s of its own keys, the base's keys and the non-expert weights; cold_starts [N, W]
    outside wake-ups; wakes[n]: [wake-ups, 3] (window, seconds, 1 where the base was warm: another
    fine-tune awake held the non-expert weights); batched_step_s [W]: the engine's expert GPU seconds
    per step over every fine-tune busy in the window; routed_keys [W]: the keys its calls route to (each
    awake fine-tune's own keys it routes to, and the base's keys any of them routes to)."""

    held_bytes: np.ndarray
    extra_non_expert: np.ndarray
    gb_s: np.ndarray
    cold_starts: np.ndarray
    wakes: list[np.ndarray]
    batched_step_s: np.ndarray
    routed_keys: np.ndarray


def even_shares(held: np.ndarray, claims: np.ndarray, last: np.ndarray) -> np.ndarray:
    """One window's shares of each held key, by the hosts' rule (expert_fn/host/meters.py): held [K]
    bool, claims [N, K] bool, last [N, K] each model's last window claiming the key in its residency
    (-1: none) -> [N, K], each held key's column summing to 1, every other column 0. Evenly among the
    claimants; a held key nobody claims, evenly among those that claimed it last (a key is loaded here
    only for a claim, so its loader is among its claimants)."""
    latest = (last == last.max(axis=0)) & (last >= 0)
    payers = np.where(claims.any(axis=0), claims, latest) & held
    count = payers.sum(axis=0)
    if (held & (count == 0)).any():
        raise ValueError("a key is held that no model claimed in its residency")
    return payers / np.maximum(count, 1)


class EvenSplit:
    """Each key's GB·s, window by window, split by even_shares (step 4; the hosts' meters' rule).
    Arrays are [N, K]: models first; gb_s is the split so far."""

    def __init__(self, models: int, keys: int, key_bytes: float, window_s: float):
        self.gb_s = np.zeros((models, keys))
        self.last = np.full((models, keys), -1, np.int64)  # last window claiming it, this residency
        self.gb_per_window = key_bytes * window_s / 1e9

    def window(self, w: int, held: np.ndarray, claims: np.ndarray) -> None:
        """Window w: held [K] bool after its calls, claims [N, K] bool."""
        self.last[:, ~held] = -1  # evicted: its next residency's payers start afresh
        self.last[claims & held] = w
        self.gb_s += even_shares(held, claims, self.last) * self.gb_per_window


def wake_seconds(ahead: np.ndarray, routed_ahead: np.ndarray, demand: np.ndarray, links: int, gpus: int,
                 load_s: float) -> float:
    """A wake-up's loads [L] per layer: its wake set (ahead: loaded at once from its first call, in layer
    order over `links` GPUs), of which its tokens route to routed_ahead, and the routed keys outside it
    (demand) -> the seconds its forward waits. The forward reaches layer l at t; a call's loads go
    first (expert_fn/host/load_queue.py), `gpus` at once: layer l's demand, and its routed wake-set
    keys unless the wake set is loaded through layer l sooner. That moment counts every call's load
    before the wake set's (a bound from above).

    Golden: ahead [2, 2], routed_ahead [1, 1], demand [0, 0], 4 links, G = 2: the wake set is loaded by
    1 load's time; layer 0 waits for it (1), layer 1 for nothing more -> 1 load. Layer by layer, G
    at a time: 2 loads."""
    done = np.ceil((np.cumsum(ahead) + np.cumsum(demand)) / links) * load_s
    t = 0.0
    for l in range(len(ahead)):
        calls = t + np.ceil(demand[l] / gpus) * load_s
        t = max(calls, min(done[l], t + np.ceil((demand[l] + routed_ahead[l]) / gpus) * load_s))
    return float(t)


def shared_keys_pass(models: list[PoolModel], replaced: np.ndarray, lines: list[ModelTimeline],
                     s: PoolSettings) -> SharedKeys:
    """Steps 1-4 over the windows for fine-tunes of one base: models [N] (each its task's routing and
    the base's sizes), replaced [N, L, E] bool (a replaced expert is a key of its model's own; every
    other (l, e) the base's key), their timelines in the same order."""
    n, (layers, experts), base = len(models), models[0].popularity.shape, models[0]
    own = replaced.reshape(n, -1)
    keep, steps = int(round(s.keep_alive_s / s.window_s)), s.window_s / s.step_s
    routing = np.stack([m.popularity.reshape(-1) for m in models]) * base.top_k  # [N, L x E] pairs per token
    kept = np.stack([warm_mask(m.popularity, s.keep_warm).reshape(-1) for m in models])  # claimed all along
    kept_base = (kept & ~own).any(axis=0)
    last = np.full(own.shape, -10**9)  # each model's claim: the last window it routed to an expert
    row = np.zeros(n, np.int64)  # each model's next row of hits (its awake windows in order)
    split = EvenSplit(n, layers * experts, base.expert_bytes, s.window_s)
    non_expert = EvenSplit(n, 1, base.non_expert_bytes, s.window_s)
    own_windows = np.zeros(n)  # windows x own keys held, per model
    held, extra, batched, routed = (np.zeros(s.windows) for _ in range(4))
    base_held = np.zeros(layers * experts, bool)  # the base's keys held after the last window
    cold, wakes = np.zeros((n, s.windows), np.int64), [[] for _ in range(n)]
    awake_all = np.stack([line.awake for line in lines])  # [N, W]
    for w in range(s.windows):
        awake = awake_all[:, w]
        if not awake.any() and not kept.any() and not (w and held[w - 1]):
            continue  # nothing claimed, nothing held: the splits' residencies were reset a window ago
        steady = awake & (awake_all[:, w - 1] if w else False)
        # 1. Resident before the calls: the base's keys any steady model claims, each model's own.
        claimed = (w - last <= keep) & steady[:, None] | kept
        idle_user = (~own & ~steady[:, None]).any(axis=0)  # a base key a fine-tune not calling steadily uses
        base_before = (claimed & ~own).any(axis=0) | (base_held & s.family_warm & steady.any() & idle_user)
        own_before = claimed & own
        # 2. The calls: cold starts and wake-ups.
        waking = []
        routed_base = np.zeros(layers * experts, bool)
        for m in np.flatnonzero(awake):
            hit = lines[m].hits[row[m]].reshape(-1)
            row[m] += 1
            held_m = np.where(own[m], own_before[m], base_before)  # its keys resident before its calls
            missing = hit & ~held_m
            if steady[m]:
                cold[m, w] = int(missing.sum())
            else:  # step 2's wake-up, timed once the pool's GPUs are known (below)
                placed = base_before | (own_before & own).any(axis=0, where=np.arange(n)[:, None] != m)
                ahead = ~held_m & placed  # its experts where another's is held
                per_layer = [x.reshape(layers, experts).sum(axis=1) for x in (ahead, missing & ahead, missing & ~ahead)]
                waking.append((m, per_layer, steady.any()))
                last[m] = w
            last[m][hit] = w
            routed[w] += int((hit & own[m]).sum())
            routed_base |= hit & ~own[m]
        routed[w] += int(routed_base.sum())
        # 3. Held after the calls.
        claims = (w - last <= keep) & awake[:, None] | kept
        asleep_user = (~own & ~awake[:, None]).any(axis=0)  # a base key a fine-tune asleep uses (it may wake)
        siblings = (claims & own).any(axis=0) & s.family_warm & asleep_user  # where a fine-tune holds its own
        base_now = base_held = (claims & ~own).any(axis=0) | (base_held & s.family_warm & awake.any() & asleep_user) | siblings
        own_now = (claims & own).sum(axis=1)
        own_windows += own_now
        held[w] = (base_now.sum() + own_now.sum()) * float(base.expert_bytes) + awake.any() * float(base.non_expert_bytes)
        extra[w] = max(int(awake.sum()) - 1, 0) * float(base.non_expert_bytes)
        links = max(base.gpus, int(np.ceil(held[w] / s.gpu_bytes - 1e-9)))  # the pool's GPUs: a PCIe link each
        for m, (ahead, routed_ahead, demand), warm in waking:
            loads_s = wake_seconds(ahead, routed_ahead, demand, links, base.gpus, base.expert_load_s)
            wakes[m].append((w, (0.0 if warm else base.non_expert_load_s) + loads_s, float(warm)))
        # 4. The split (own keys are their model's: own_windows), the engine's batched step.
        split.window(w, base_now, claims & ~own | (claims & own if s.family_warm else False))
        non_expert.window(w, np.array([awake.any()]), awake[:, None])
        sent = np.array([line.tokens[w] if line.busy[w] else 0.0 for line in lines])
        if sent.any():
            tokens = sent[:, None] * routing
            rate = np.concatenate([tokens[own], tokens.sum(axis=0, where=~own)]) / steps  # own keys, then the base's
            batched[w] = -np.expm1(-rate).sum() * base.call_s + sent.sum() / steps * base.top_k * base.alpha_s
    own_gb = own_windows * base.expert_bytes * s.window_s / 1e9
    parts = np.stack([own_gb, split.gb_s.sum(axis=1), non_expert.gb_s[:, 0]], axis=1)
    return SharedKeys(held, extra, parts, cold, [np.asarray(x, float).reshape(-1, 3) for x in wakes], batched, routed)
