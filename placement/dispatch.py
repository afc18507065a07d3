"""Dispatch-time pairing: each layer call's tokens assigned to the replicas that hold their experts,
on this batch's own loads, once its gate has run (the rule the twin and the data plane share).

The imbalance of a fine-grained MoE is mostly each batch's own: a pairing of experts to GPUs chosen
from past loads keeps little of it, while every batch's loads are known exactly before its tokens
are sent. So, per layer call, with the loads W [E] and the resident replicas (expert, gpu):

1. Three starts, each a token count per replica:
   a. the plan's own shares (whole tokens, largest remainder);
   b. every expert on its first replica (its home; static EP's split where the plan lists homes
      first, as moeless's planners do);
   c. whole experts: those with one GPU first, then the others largest first, each to the least
      loaded GPU that holds it.
2. Each start improved in rounds: the busiest GPU hands tokens of one of its experts to another GPU
   holding that expert, the move that lowers the pair's larger work the most: all of the expert's
   tokens there (its call moves too), or a split that evens the pair, made only of an expert
   whose tokens there pass the knee (c / alpha: below it a call's fixed cost dominates, and a
   split doubles it). Stops when no move lowers the busiest GPU. With split=False (hosts whose
   kernel is not split-exact: bit-identical outputs need each expert's rows computed together)
   only whole experts move, and a start that splits an expert is dropped.
3. The start with the least serial layer time wins (kernels.serial_time's rule: busiest GPU's alpha x
   tokens + c per call with tokens, plus 2 beta x the most tokens a GPU receives); ties go to the
   earlier start, so the plan's shares and static EP's split are never beaten by a worse pairing.

Compiled (numba): microseconds per layer (`moeless bench planner` times it). Which experts each
GPU holds is the planner's choice; this only chooses who computes what among them.

Golden example (alpha = 1 s per token, c = 2, beta = 0; 2 GPUs; experts 0, 1 at home on GPU 0 and
2, 3 on GPU 1; expert 1 also on GPU 1; W = [6, 5, 1, 0]): the plan (every expert at home) makes
GPU 0 work 6 + 2 + 5 + 2 = 15 and GPU 1 3. Expert 1 moving whole to GPU 1 makes 8 and 10 (evening
the pair would move 5 tokens, all of them): tokens per replica [6, 0, 1, 0 | 5] (the copy of
expert 1 last), layer time 10; no move lowers GPU 1 further.
"""

from __future__ import annotations

import weakref

import numpy as np

from moeless.placement.kernels import compiled, largest_remainder
from moeless.placement.latency_model import LatencyModel
from moeless.placement.types import LayerPlacement

EPSILON_S = 1e-12  # a move must lower the busiest GPU by more than rounding


def pair_tokens(load: np.ndarray, layer: LayerPlacement, model: LatencyModel, num_gpus: int,
                split: bool = True) -> LayerPlacement:
    """The layer's replicas with shares that pair this batch's loads with them (module docstring).
    load: [E] whole tokens per expert -> the same replicas (expert, gpu), new shares; one replica per
    expert comes back as it is (nothing to choose). split=False: whole experts only (every start and
    move keeps each expert's tokens on one replica: hosts whose expert kernel rounds a part of an
    expert's rows differently from all of them, hardware/host_profile.split_exact). The layer's
    index of replicas by expert is made once per layer object (`pairing_index`), not per call."""
    tokens = np.asarray(load, dtype=np.int64)
    if layer.num_replicas == tokens.shape[0]:
        return layer
    packed, first = pairing_index(layer, tokens.shape[0], num_gpus)
    return LayerPlacement(layer.expert, layer.gpu, _paired_shares(tokens, packed, layer.share, model.alpha,
                                                                  model.call_overhead, model.beta, split, first))


def pairing_index(layer: LayerPlacement, num_experts: int, num_gpus: int) -> tuple[np.ndarray, bool]:
    """(packed, home_first) of the layer's replicas, made once per layer object: packed is one int64
    array of E, G, R, F, M and _by_expert's start, members, owner, at, then flexible (the F experts
    held on two GPUs or more), expert and gpu (`_unpack`; one array, since numba unboxes each
    argument at every call: ten arrays cost 3.5 us, more than the pairing); home_first: each
    expert's first replica has share 1 and every other 0, as moeless-sets' and full replication's
    plans list them. A published layer serves many calls, and the index costs more than the
    pairing (5 us at E = 64, G = 8, measured). The cache holds the layer weakly: its entry goes
    with it."""
    key = id(layer)
    hit = _INDEX.get(key)
    if hit is not None and hit[0]() is layer and hit[1] == (num_experts, num_gpus):
        return hit[2]
    expert, gpu = layer.expert.astype(np.int64), layer.gpu.astype(np.int64)
    start, members, owner, at = _by_expert(expert, gpu, num_experts, num_gpus)
    flexible = np.flatnonzero(start[1:] - start[:-1] > 1)
    home = np.zeros(layer.num_replicas, bool)
    home[members[start[:-1][start[1:] > start[:-1]]]] = True
    head = [num_experts, num_gpus, expert.shape[0], flexible.shape[0], members.shape[0]]
    packed = np.concatenate([head, start, members, owner, at.reshape(-1), flexible, expert, gpu]).astype(np.int64)
    index = (packed, bool(np.array_equal(layer.share, home.astype(np.float64))))
    if hit is None or hit[0]() is not layer:
        weakref.finalize(layer, _INDEX.pop, key, None)
    _INDEX[key] = (weakref.ref(layer), (num_experts, num_gpus), index)
    return index


_INDEX: dict[int, tuple] = {}  # id(layer) -> (weak ref to the layer, (E, G), index); dropped with the layer


@compiled
def _paired_shares(tokens, packed, share, alpha, call, beta, split, home_first):
    """_pair_indexed's pairing as shares [R], on pairing_index's packed index (one call from Python)."""
    num_experts, num_gpus, expert, gpu, start, members, owner, at, flexible = _unpack(packed)
    counts = _pair_indexed(tokens, expert, gpu, share, num_gpus, alpha, call, beta, split, start, members, owner, at,
                           flexible, home_first)[0]
    return _shares(counts, tokens, expert)


@compiled
def _unpack(packed):
    """pairing_index's packed array -> (E, G, expert, gpu, start, members, owner, at [E, G], flexible): views."""
    num_experts, num_gpus, num_replicas, num_flexible, num_members = packed[0], packed[1], packed[2], packed[3], packed[4]
    o = 5
    start = packed[o:o + num_experts + 1]
    o += num_experts + 1
    members = packed[o:o + num_members]
    o += num_members
    owner = packed[o:o + num_replicas]
    o += num_replicas
    at = packed[o:o + num_experts * num_gpus].reshape((num_experts, num_gpus))
    o += num_experts * num_gpus
    flexible = packed[o:o + num_flexible]
    o += num_flexible
    expert = packed[o:o + num_replicas]
    gpu = packed[o + num_replicas:o + 2 * num_replicas]
    return num_experts, num_gpus, expert, gpu, start, members, owner, at, flexible


@compiled
def _shares(counts, tokens, expert):
    """Shares [R] from whole tokens per replica; an expert without tokens routes to its first replica."""
    out = np.zeros(expert.shape[0])
    routed = np.zeros(tokens.shape[0], np.bool_)
    for r in range(expert.shape[0]):
        e = expert[r]
        if tokens[e] > 0:
            out[r] = counts[r] / tokens[e]
        elif not routed[e]:
            out[r], routed[e] = 1.0, True
    return out


@compiled
def pair_counts(tokens, expert, gpu, share, num_gpus, alpha, call, beta):
    """Whole tokens per replica [R] of the best start of the module docstring's steps 1-3.
    tokens [E] int, expert [R], gpu [R], share [R] (the plan's)."""
    return _pair(tokens, expert, gpu, share, num_gpus, alpha, call, beta)[0]


@compiled
def paired_seconds(tokens, expert, gpu, share, num_gpus, alpha, call, beta):
    """The serial layer time of pair_counts' pairing (what a replica set is worth on a batch)."""
    return _pair(tokens, expert, gpu, share, num_gpus, alpha, call, beta)[1]


@compiled
def _pair(tokens, expert, gpu, share, num_gpus, alpha, call, beta, split=True):
    start, members, owner, at = _by_expert(expert, gpu, tokens.shape[0], num_gpus)
    flexible = np.flatnonzero(start[1:] - start[:-1] > 1)
    return _pair_indexed(tokens, expert, gpu, share, num_gpus, alpha, call, beta, split, start, members, owner, at,
                         flexible, False)


@compiled
def _pair_indexed(tokens, expert, gpu, share, num_gpus, alpha, call, beta, split, start, members, owner, at, flexible,
                  home_first):
    """Steps 1-3 on the layer's index (_by_expert); home_first: start a. is start b. (skipped)."""
    num_replicas, num_experts = expert.shape[0], tokens.shape[0]
    knee = (call / alpha if alpha > 0 else 0.0) if split else np.inf
    best = np.zeros(num_replicas, np.int64)
    best_s = np.inf  # a plan that splits an expert is no start where experts stay whole
    if not home_first:
        best = largest_remainder(tokens, expert, share)  # a.
        for r in range(num_replicas):  # a twin's tokens to the one replica of its (expert, GPU)
            if owner[r] != r:
                best[owner[r]] += best[r]
                best[r] = 0
        if split or _whole_counts(best, expert, num_experts):
            _improve(best, tokens, gpu, start, members, at, flexible, num_gpus, alpha, call, knee)
            best_s = _seconds(best, gpu, num_gpus, alpha, call, beta)
    for kind in range(2):  # b. home, c. whole experts to the least loaded holder
        counts = _home(tokens, expert, start, members, num_replicas) if kind == 0 else \
            _whole(tokens, expert, gpu, start, members, flexible, num_gpus, alpha, call, num_replicas)
        _improve(counts, tokens, gpu, start, members, at, flexible, num_gpus, alpha, call, knee)
        seconds = _seconds(counts, gpu, num_gpus, alpha, call, beta)
        if seconds < best_s - EPSILON_S:
            best, best_s = counts, seconds
    return best, best_s


@compiled
def _whole_counts(counts, expert, num_experts):
    """Whether every expert's tokens are on one replica."""
    held = np.zeros(num_experts, np.int64)
    for r in range(counts.shape[0]):
        if counts[r] > 0:
            held[expert[r]] += 1
    return held.max() <= 1


@compiled
def _seconds(counts, gpu, num_gpus, alpha, call, beta):
    """The serial layer time of whole tokens per replica (kernels.serial_time's rule, from counts)."""
    tokens = np.zeros(num_gpus, np.int64)
    work = np.zeros(num_gpus)
    for r in range(counts.shape[0]):
        if counts[r] > 0:
            tokens[gpu[r]] += counts[r]
            work[gpu[r]] += call + alpha * counts[r]
    return work.max() + 2.0 * beta * tokens.max()


@compiled
def _by_expert(expert, gpu, num_experts, num_gpus):
    """Each expert's replicas, one per GPU (the first listed there), in listed order: members
    [start[e]:start[e + 1]] are replica indices (CSR); owner [R]: the member each replica's
    (expert, GPU) is (an expert twice on one GPU, as EPLB's packing can do, is one replica there);
    at [E, G]: the member of (expert, GPU), or -1."""
    first = np.full((num_experts, num_gpus), -1, np.int64)
    owner = np.empty(expert.shape[0], np.int64)
    size = np.zeros(num_experts + 1, np.int64)
    for r in range(expert.shape[0]):
        if first[expert[r], gpu[r]] < 0:
            first[expert[r], gpu[r]] = r
            size[expert[r] + 1] += 1
        owner[r] = first[expert[r], gpu[r]]
    start = np.cumsum(size)
    fill = start[:-1].copy()
    members = np.empty(start[-1], np.int64)
    for r in range(expert.shape[0]):
        if owner[r] == r:
            members[fill[expert[r]]] = r
            fill[expert[r]] += 1
    return start, members, owner, first


@compiled
def _home(tokens, expert, start, members, num_replicas):
    counts = np.zeros(num_replicas, np.int64)
    for e in range(tokens.shape[0]):
        counts[members[start[e]]] = tokens[e]
    return counts


@compiled
def _whole(tokens, expert, gpu, start, members, flexible, num_gpus, alpha, call, num_replicas):
    """Whole experts: one-GPU experts first, then the others (`flexible`) largest first (stable),
    each to its least loaded holder (the earlier listed on ties)."""
    counts = np.zeros(num_replicas, np.int64)
    work = np.zeros(num_gpus)
    for e in range(tokens.shape[0]):
        if tokens[e] > 0 and start[e + 1] - start[e] == 1:
            r = members[start[e]]
            counts[r] = tokens[e]
            work[gpu[r]] += call + alpha * tokens[e]
    order = flexible[np.argsort(-tokens[flexible], kind="mergesort")]
    for i in range(order.shape[0]):
        e = order[i]
        if tokens[e] == 0:
            break
        pick = members[start[e]]
        for j in range(start[e] + 1, start[e + 1]):
            if work[gpu[members[j]]] < work[gpu[pick]] - EPSILON_S:
                pick = members[j]
        counts[pick] = tokens[e]
        work[gpu[pick]] += call + alpha * tokens[e]
    return counts


@compiled
def _improve(counts, tokens, gpu, start, members, at, flexible, num_gpus, alpha, call, knee):
    """Step 2, in place on counts [R]: moves off the busiest GPU while one lowers it (only experts
    held on two GPUs or more can move: `flexible`)."""
    work = np.zeros(num_gpus)
    for r in range(gpu.shape[0]):
        if counts[r] > 0:
            work[gpu[r]] += call + alpha * counts[r]
    for _ in range(4 * (flexible.shape[0] + num_gpus)):
        top = np.argmax(work)
        most = work[top]
        best, src, dst, moved = most, -1, -1, 0
        for f in range(flexible.shape[0]):
            e = flexible[f]
            r = at[e, top]
            if r < 0 or counts[r] == 0:
                continue
            have = counts[r]
            for j in range(start[e], start[e + 1]):
                q = members[j]
                if q == r:
                    continue
                extra = call if counts[q] == 0 else 0.0
                after = max(most - call - alpha * have, work[gpu[q]] + extra + alpha * have)  # all of it
                part = have
                even = int(np.floor((most - work[gpu[q]] - extra) / (2.0 * alpha) + 1e-6)) if alpha > 0 else 0  # rounding
                if have > knee and 0 < even < have:  # a split, only of tokens past the knee
                    split = max(most - alpha * even, work[gpu[q]] + extra + alpha * even)
                    if split < after:
                        after, part = split, even
                if after < best - EPSILON_S:
                    best, src, dst, moved = after, r, q, part
        if src < 0:
            return
        work[gpu[src]] -= alpha * moved + (call if moved == counts[src] else 0.0)
        work[gpu[dst]] += alpha * moved + (call if counts[dst] == 0 else 0.0)
        counts[src] -= moved
        counts[dst] += moved
