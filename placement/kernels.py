"""Compiled inner loops of the planner (numba): the fill and its bisection, bins onto GPUs, idle
experts, re-levelling resident replicas, whole-token splits and the serial layer time. Planning
must hide behind one layer's compute (~0.2 ms); these loops run tens of times per layer at
~0.3 us per step in Python, an order of magnitude less compiled.

Each kernel is a plain loop over arrays, documented with the rule it implements; the policy
around them lives in placement/fill_placer.py. Compiled once per checkout (cached next to this
file, or in numba's user cache when that is read-only): ~14 s on a 2-core CPU, then ~0.2 s to load.
"""

from __future__ import annotations

import math

import numpy as np
from numba import njit


def compiled(fn):
    """`njit` with numba's on-disk cache where numba finds a writable place for it; where it finds
    none ("no locator available": an image whose sources and home are read-only and NUMBA_CACHE_DIR
    unwritable), compiled in memory at each start instead of failing the import."""
    try:
        return njit(cache=True)(fn)
    except RuntimeError as err:
        if "no locator available" not in str(err):
            raise
        return njit(fn)


@compiled
def fill(tokens, order, caps, call, level, cuts, out_expert, out_bin, out_tokens):
    """Fill bins in turn up to `level` work (tokens + `call` per piece), walking experts in `order`.

    tokens: [E] float; order: [n] int, experts with tokens; caps: [B] int, pieces each bin may
    hold; cuts: pieces allowed beyond one per expert. An expert that overflows the current bin is
    cut: the bin takes the whole tokens that fit (at least one, leaving at least one), the rest
    goes on to the next bin. Writes pieces (expert, bin, tokens) to the out arrays ([n + cuts]);
    returns how many, or -1 when the bins run out.
    """
    count, b, room, held, cap, num_bins = 0, 0, level, 0, caps[0], caps.shape[0]
    for i in range(order.shape[0]):
        e = order[i]
        t = tokens[e]
        while True:
            if held < cap and t + call <= room:
                out_expert[count], out_bin[count], out_tokens[count] = e, b, t
                count += 1
                room -= t + call
                held += 1
                break
            cut = math.floor(room - call)
            if cuts > 0 and held < cap and cut >= 1 and t - cut >= 1:
                out_expert[count], out_bin[count], out_tokens[count] = e, b, cut
                count += 1
                t -= cut
                cuts -= 1
            b += 1
            if b == num_bins:
                return -1
            room, held, cap = level, 0, caps[b]
    return count


@compiled
def lowest_level(tokens, order, caps, call, budget, split, tolerance):
    """The lowest level (to `tolerance`) at which `fill` fits: (level, expert [P], bin [P], tokens [P]).

    Below max((total + call n) / B, call + 1) nothing fits (n experts, B bins; without splits,
    call + the largest expert). The bracket grows from there by call + 1, doubling, up to one bin
    running everything; then bisection. level is -1 when no level fits (slots or budget).
    """
    n = order.shape[0]
    cuts = max(budget - n, 0) if split else 0
    size = n + cuts
    best_e, best_b, best_t = np.empty(size, np.int64), np.empty(size, np.int64), np.empty(size, np.float64)
    try_e, try_b, try_t = np.empty(size, np.int64), np.empty(size, np.int64), np.empty(size, np.float64)
    if n == 0:
        return 0.0, best_e[:0], best_b[:0], best_t[:0]
    if budget < n:
        return -1.0, best_e[:0], best_b[:0], best_t[:0]
    total, largest = 0.0, 0.0
    for i in range(n):
        total += tokens[order[i]]
        largest = max(largest, tokens[order[i]])
    low = max((total + call * n) / caps.shape[0], call + (1.0 if split else largest))
    ceiling = max(low, total + call * n + 1.0)
    high, step = min(low + call + 1.0, ceiling), call + 1.0
    found = fill(tokens, order, caps, call, high, cuts, best_e, best_b, best_t)
    while found < 0:
        if high >= ceiling:
            return -1.0, best_e[:0], best_b[:0], best_t[:0]
        low, high, step = high, min(high + step, ceiling), 2.0 * step
        found = fill(tokens, order, caps, call, high, cuts, best_e, best_b, best_t)
    while high - low > tolerance:
        mid = 0.5 * (low + high)
        count = fill(tokens, order, caps, call, mid, cuts, try_e, try_b, try_t)
        if count < 0:
            low = mid
        else:
            high, found = mid, count
            best_e, try_e = try_e, best_e
            best_b, try_b = try_b, best_b
            best_t, try_t = try_t, best_t
    return high, best_e[:found], best_b[:found], best_t[:found]


@compiled
def assign_bins(bins, experts, was_warm, free):
    """GPU of each bin: [B], B = G. bins, experts: [P] the fill's pieces; was_warm: [E, G] 1 where
    an expert is resident; free: [G] slots. Bins with the most warm pieces on one GPU go first
    (then those with the most pieces); each takes the untaken GPU with room (free >= its pieces)
    holding the most of its pieces warm, then the most free slots, then the lowest index. If that
    greedy order corners itself, bin b takes the GPU with the b-th fewest free slots (the caps the
    fill was given, so it always fits)."""
    num_gpus = free.shape[0]
    overlap = np.zeros((num_gpus, num_gpus), np.int64)
    held = np.zeros(num_gpus, np.int64)
    for p in range(bins.shape[0]):
        held[bins[p]] += 1
        for g in range(num_gpus):
            overlap[bins[p], g] += was_warm[experts[p], g]
    best = np.zeros(num_gpus, np.int64)
    for b in range(num_gpus):
        for g in range(num_gpus):
            best[b] = max(best[b], overlap[b, g])
    order = np.argsort(-(best * (held.max() + 1) + held), kind="mergesort")
    taken = np.zeros(num_gpus, np.bool_)
    gpu_of = np.full(num_gpus, -1, np.int64)
    for b in order:
        choice = -1
        for g in range(num_gpus):
            if taken[g] or free[g] < held[b]:
                continue
            if choice < 0 or overlap[b, g] > overlap[b, choice] or (overlap[b, g] == overlap[b, choice] and free[g] > free[choice]):
                choice = g
        if choice < 0:
            return np.argsort(free, kind="mergesort")
        gpu_of[b] = choice
        taken[choice] = True
    return gpu_of


@compiled
def resident_order(resident_experts, num_experts):
    """Experts in the order a resident placement first holds them ([R] replica experts), then
    those it lacks, by index: [E]."""
    seen = np.zeros(num_experts, np.bool_)
    order = np.empty(num_experts, np.int64)
    count = 0
    for e in resident_experts:
        if e < num_experts and not seen[e]:
            seen[e] = True
            order[count] = e
            count += 1
    for e in range(num_experts):
        if not seen[e]:
            order[count] = e
            count += 1
    return order


@compiled
def largest_remainder(expert_tokens, expert, share):
    """Whole tokens per replica: [R] int. Replica r gets floor(expert_tokens[expert[r]] * share[r]);
    each expert's missing tokens go one each to its replicas with the largest remainders (ties:
    the lower replica index)."""
    num_replicas = expert.shape[0]
    counts = np.empty(num_replicas, np.int64)
    remainder = np.empty(num_replicas, np.float64)
    missing = expert_tokens.copy()
    for r in range(num_replicas):
        exact = expert_tokens[expert[r]] * share[r]
        counts[r] = math.floor(exact)
        remainder[r] = exact - counts[r]
        missing[expert[r]] -= counts[r]
    bumped = np.zeros(num_replicas, np.bool_)
    for r in range(num_replicas):
        e = expert[r]
        while missing[e] > 0:  # the first replica of each expert hands out its expert's missing tokens
            pick = -1
            for q in range(r, num_replicas):
                if expert[q] == e and not bumped[q] and (pick < 0 or remainder[q] > remainder[pick]):
                    pick = q
            if pick < 0:
                break
            bumped[pick] = True
            counts[pick] += 1
            missing[e] -= 1
    return counts


@compiled
def place_idle(idle, was_warm, left):
    """GPU of each expert without tokens: [n]. idle: [n] experts; was_warm: [E, G] 1 where the
    expert is resident; left: [G] free slots, decremented in place. The first resident GPU with
    a slot left, else the GPU with the most slots left (it costs a slot, never time)."""
    gpus = np.empty(idle.shape[0], np.int64)
    for i in range(idle.shape[0]):
        choice = -1
        for g in range(left.shape[0]):
            if was_warm[idle[i], g] and left[g] > 0:
                choice = g
                break
        if choice < 0:
            choice = np.argmax(left)
        gpus[i] = choice
        left[choice] -= 1
    return gpus


@compiled
def reshare(load, expert, gpu, call, num_gpus):
    """Token shares of fixed replicas: [R]. load: [E]; expert, gpu: [R] the resident replicas.

    Experts from most to least loaded (LPT) water-fill their tokens over the GPUs that hold them,
    least-loaded first: k replicas share the tokens when that gives the lowest common level
    (work + piece + call), every piece at least one token. Replicas left without tokens keep a
    zero share (they stay warm); an expert without tokens gives its first replica share 1.
    """
    num_replicas = expert.shape[0]
    share = np.zeros(num_replicas)
    work = np.zeros(num_gpus)
    mine = np.empty(num_replicas, np.int64)
    for e in np.argsort(-load, kind="mergesort"):
        count = 0
        for r in range(num_replicas):
            if expert[r] == e:
                mine[count] = r
                count += 1
        if count == 0:
            continue
        w = load[e]
        if w <= 0:
            share[mine[0]] = 1.0
            continue
        ranked = mine[:count][np.argsort(work[gpu[mine[:count]]], kind="mergesort")]
        best_k, best_level, under = 1, w + work[gpu[ranked[0]]] + call, 0.0
        for k in range(1, count + 1):
            under += work[gpu[ranked[k - 1]]] + call
            level = (w + under) / k
            if level - work[gpu[ranked[k - 1]]] - call < 1.0:
                break
            if level < best_level:
                best_k, best_level = k, level
        for j in range(best_k):
            r = ranked[j]
            piece = best_level - work[gpu[r]] - call if best_k > 1 else w
            share[r] = piece / w
            work[gpu[r]] += piece + call
    return share


@compiled
def serial_time(expert_tokens, expert, gpu, share, num_gpus, alpha, call_overhead, beta):
    """Seconds of one MoE layer when replicas on a GPU run one after another: the busiest GPU's
    sum of alpha * tokens + call_overhead per replica with tokens, plus 2 beta times the most
    tokens any GPU receives. Tokens are whole, each expert's split by `largest_remainder`."""
    counts = largest_remainder(expert_tokens, expert, share)
    tokens = np.zeros(num_gpus, np.int64)
    calls = np.zeros(num_gpus, np.int64)
    for r in range(expert.shape[0]):
        tokens[gpu[r]] += counts[r]
        calls[gpu[r]] += counts[r] > 0
    work, most = 0.0, 0
    for g in range(num_gpus):
        work = max(work, alpha * tokens[g] + call_overhead * calls[g])
        most = max(most, tokens[g])
    return work + 2.0 * beta * most


@compiled
def most_cold_loads(expert, gpu, was_warm, num_gpus):
    """Replicas the GPU that loads the most must load: those not resident (was_warm [E, G] == 0)."""
    loads = np.zeros(num_gpus, np.int64)
    for r in range(expert.shape[0]):
        if was_warm[expert[r], gpu[r]] == 0:
            loads[gpu[r]] += 1
    return loads.max()


@compiled
def fill_plan(load, order, idle, free, was_warm, call, budget, split, tolerance):
    """The fill at its lowest level, on GPUs: (level, expert [R], gpu [R], share [R], left [G]);
    level -1 when it does not fit. One slot is kept per idle expert; bin b may hold as many
    replicas as the b-th fewest free slots (walked most loaded first, the last bins end with the
    many small experts); bins go to GPUs by `assign_bins`, idle experts by `place_idle`."""
    caps = np.sort(free)
    level, expert, bins, tokens = lowest_level(load, order, caps, call, budget - idle.shape[0], split, tolerance)
    pieces = expert.shape[0]
    if level < 0 or free.sum() - pieces < idle.shape[0]:
        return -1.0, expert, bins, tokens, free.copy()
    gpu_of = assign_bins(bins, expert, was_warm, free)
    left = free.copy()
    size = pieces + idle.shape[0]
    out_expert, out_gpu, share = np.empty(size, np.int64), np.empty(size, np.int64), np.ones(size)
    for p in range(pieces):
        out_expert[p], out_gpu[p] = expert[p], gpu_of[bins[p]]
        share[p] = tokens[p] / load[expert[p]]
        left[out_gpu[p]] -= 1
    out_expert[pieces:] = idle
    out_gpu[pieces:] = place_idle(idle, was_warm, left)
    return level, out_expert, out_gpu, share, left
