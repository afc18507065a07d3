"""Compiled inner loops of moeless's resident planner (numba): grow the resident replicas of one
layer one priced replica at a time. The policy is placement/resident_planner.py; see there.

Work is counted in tokens: a GPU's work is its replicas' tokens plus `call` (the call overhead in
tokens) per replica with tokens; the layer takes alpha * max work + 2 beta * max tokens (the
serial model of LatencyModel, on whole tokens).
"""

from __future__ import annotations

import numpy as np
from moeless.placement.kernels import compiled, largest_remainder


@compiled
def layer_seconds(tok, calls, alpha, call_overhead, beta):
    """Serial layer time from per-GPU tokens [G] and calls with tokens [G]."""
    work, most = 0.0, 0
    for g in range(tok.shape[0]):
        work = max(work, alpha * tok[g] + call_overhead * calls[g])
        most = max(most, tok[g])
    return work + 2.0 * beta * most


@compiled
def water_fill(w, other, call, pieces):
    """Split w whole tokens over GPUs whose other work is other [k] (ascending): the lowest common
    level, every piece at least one token (as kernels.reshare). Writes pieces [k]; returns the
    number of GPUs used."""
    k_all = other.shape[0]
    best_k, best_level, under = 1, w + other[0] + call, 0.0
    for k in range(1, k_all + 1):
        under += other[k - 1] + call
        level = (w + under) / k
        if level - other[k - 1] - call < 1.0:
            break
        if level < best_level:
            best_k, best_level = k, level
    given = 0
    for j in range(k_all):
        pieces[j] = 0
    for j in range(best_k):
        piece = int(np.floor(best_level - other[j] - call)) if best_k > 1 else int(w)
        pieces[j] = max(piece, 1)
        given += pieces[j]
    j = 0
    while given < w:  # whole tokens: the rest one each to the least loaded
        pieces[j % best_k] += 1
        given += 1
        j += 1
    while given > w:
        if pieces[j % best_k] > 1:
            pieces[j % best_k] -= 1
            given -= 1
        j += 1
    return best_k


@compiled
def grow(load, expert, gpu, tokens, free, budget, call, alpha, call_overhead, beta,
         load_s, hide_layers, memory_s, horizon, epsilon, lookahead):
    """Add replicas to one layer in steps, each step's priced gain beating its cost.

    load: [E] int tokens; expert, gpu, tokens: [R] the resident replicas and their whole tokens
    (re-levelled); free: [G] slots the layer may use in all; budget: most replicas. A candidate is a
    replica of an expert with tokens on the busiest GPU, on another GPU with a free slot; its expert
    is re-levelled over its GPUs (water_fill). Its cost is the exposed part of one more cold load on
    its GPU (loads x load_s beyond hide_layers x the layer's time) + memory_s. A step tries up to
    `lookahead` candidates in a row, each the one that leaves the layer fastest over the horizon
    after its cost (ties: the more even GPUs, so several stragglers are relieved in turn), and
    keeps the prefix whose gain, (time before - time after) x horizon, beats its summed cost by the
    most; no such prefix: stop. Returns (expert, gpu, tokens) after the additions and the additions
    as rows (expert, gpu, gain, cost, layer time before it, cold loads its GPU had, step) [A, 7].
    """
    num_gpus, cap = free.shape[0], budget
    out_e = np.empty(cap, np.int64)
    out_g = np.empty(cap, np.int64)
    out_t = np.empty(cap, np.int64)
    n = expert.shape[0]
    out_e[:n], out_g[:n], out_t[:n] = expert, gpu, tokens
    tok = np.zeros(num_gpus, np.int64)
    calls = np.zeros(num_gpus, np.int64)
    held = np.zeros(num_gpus, np.int64)
    for r in range(n):
        tok[out_g[r]] += out_t[r]
        calls[out_g[r]] += out_t[r] > 0
        held[out_g[r]] += 1
    cold = np.zeros(num_gpus, np.int64)
    rows = np.empty((max(cap - n, 0), 7))
    count, step = 0, 0
    mine = np.empty(cap, np.int64)
    other = np.empty(cap + 1)
    pieces = np.empty(cap + 1, np.int64)
    new_tok = np.empty(num_gpus, np.int64)
    new_calls = np.empty(num_gpus, np.int64)
    # The state of the last kept step, restored when a tentative run does not pay.
    keep_t, keep_tok, keep_calls = out_t.copy(), tok.copy(), calls.copy()
    keep_held, keep_cold, keep_n, keep_count = held.copy(), cold.copy(), n, count
    now = layer_seconds(tok, calls, alpha, call_overhead, beta)
    while n < cap:
        start, spent, best_net, paid = now, 0.0, epsilon, False
        for _ in range(lookahead):
            if n >= cap:
                break
            straggler = 0
            for g in range(num_gpus):
                if tok[g] + call * calls[g] > tok[straggler] + call * calls[straggler]:
                    straggler = g
            best_score, best_even, best_e, best_g, best_time, best_cost = np.inf, np.inf, -1, -1, 0.0, 0.0
            for r in range(n):
                e = out_e[r]
                if out_g[r] != straggler or out_t[r] == 0 or load[e] < 2:
                    continue
                m = _replicas_of(out_e, e, n, mine)
                for g in range(num_gpus):
                    if held[g] >= free[g]:
                        continue
                    taken = False
                    for j in range(m):
                        taken = taken or out_g[mine[j]] == g
                    if taken:
                        continue
                    out_e[n], out_g[n], out_t[n] = e, g, 0  # tentatively, to re-level over
                    mine[m] = n
                    after = _refill(load[e], mine, m + 1, out_g, out_t, tok, calls, call, other, pieces, new_tok,
                                    new_calls, alpha, call_overhead, beta, False)
                    hide = hide_layers * now
                    cost = max((cold[g] + 1) * load_s - hide, 0.0) - max(cold[g] * load_s - hide, 0.0) + memory_s
                    score = after * horizon + cost
                    even = 0.0
                    for h in range(num_gpus):
                        even += (new_tok[h] + call * new_calls[h]) ** 2
                    if score < best_score - epsilon or (score <= best_score + epsilon and even < best_even):
                        best_score, best_even, best_e, best_g, best_time, best_cost = score, even, e, g, after, cost
            if best_e < 0:
                break
            # Take it: the new replica, its expert re-levelled over its GPUs as priced.
            m = _replicas_of(out_e, best_e, n, mine)
            out_e[n], out_g[n], out_t[n] = best_e, best_g, 0
            mine[m] = n
            rows[count, 0], rows[count, 1], rows[count, 3] = best_e, best_g, best_cost
            rows[count, 2], rows[count, 4], rows[count, 5], rows[count, 6] = (now - best_time) * horizon, now, cold[best_g], step
            n += 1
            count += 1
            now = _refill(load[best_e], mine, m + 1, out_g, out_t, tok, calls, call, other, pieces, new_tok, new_calls,
                          alpha, call_overhead, beta, True)
            held[best_g] += 1
            cold[best_g] += 1
            spent += best_cost
            net = (start - now) * horizon - spent
            if net > best_net:  # this prefix pays best so far: keep it
                best_net, paid = net, True
                keep_t[:], keep_tok[:], keep_calls[:] = out_t, tok, calls
                keep_held[:], keep_cold[:], keep_n, keep_count = held, cold, n, count
        # Back to the last prefix that paid (all of this run's additions when none did).
        out_t[:], tok[:], calls[:] = keep_t, keep_tok, keep_calls
        held[:], cold[:] = keep_held, keep_cold
        n, count = keep_n, keep_count
        now = layer_seconds(tok, calls, alpha, call_overhead, beta)
        if not paid:
            break
        step += 1
    return out_e[:n].copy(), out_g[:n].copy(), out_t[:n].copy(), rows[:count].copy()


@compiled
def relevel(load, expert, gpu, tokens, num_gpus, call, alpha, call_overhead, beta, epsilon):
    """Local search over fixed replicas: while it shortens the layer, re-level (water_fill) one
    expert of the busiest GPU over all its GPUs, the expert that shortens it most. tokens [R] is
    updated in place; returns the layer's time."""
    n = expert.shape[0]
    tok = np.zeros(num_gpus, np.int64)
    calls = np.zeros(num_gpus, np.int64)
    for r in range(n):
        tok[gpu[r]] += tokens[r]
        calls[gpu[r]] += tokens[r] > 0
    mine = np.empty(n, np.int64)
    other = np.empty(n)
    pieces = np.empty(n, np.int64)
    new_tok = np.empty(num_gpus, np.int64)
    new_calls = np.empty(num_gpus, np.int64)
    now = layer_seconds(tok, calls, alpha, call_overhead, beta)
    for _ in range(4 * n):
        straggler = 0
        for g in range(num_gpus):
            if tok[g] + call * calls[g] > tok[straggler] + call * calls[straggler]:
                straggler = g
        best_t, best_e = now - epsilon, -1
        for r in range(n):
            e = expert[r]
            if gpu[r] != straggler or tokens[r] == 0:
                continue
            m = _replicas_of(expert, e, n, mine)
            if m < 2:
                continue
            t = _refill(load[e], mine, m, gpu, tokens, tok, calls, call, other, pieces, new_tok, new_calls,
                        alpha, call_overhead, beta, False)
            if t < best_t:
                best_t, best_e = t, e
        if best_e < 0:
            break
        m = _replicas_of(expert, best_e, n, mine)
        now = _refill(load[best_e], mine, m, gpu, tokens, tok, calls, call, other, pieces, new_tok, new_calls,
                      alpha, call_overhead, beta, True)
    return now


@compiled
def _replicas_of(expert, e, n, mine):
    m = 0
    for q in range(n):
        if expert[q] == e:
            mine[m] = q
            m += 1
    return m


@compiled
def _refill(w, mine, m, gpu, tokens, tok, calls, call, other, pieces, new_tok, new_calls, alpha, call_overhead, beta, apply):
    """The layer time with one expert (its replicas mine[:m]) water-filled over its GPUs; with
    apply, tokens, tok and calls take the new split."""
    for j in range(m):
        r = mine[j]
        other[j] = tok[gpu[r]] - tokens[r] + call * (calls[gpu[r]] - (tokens[r] > 0))
    idx = np.argsort(other[:m])
    water_fill(w, other[:m][idx], call, pieces)
    new_tok[:] = tok
    new_calls[:] = calls
    for j in range(m):
        r = mine[idx[j]]
        new_tok[gpu[r]] += pieces[j] - tokens[r]
        new_calls[gpu[r]] += (pieces[j] > 0) - (tokens[r] > 0)
        if apply:
            tokens[r] = pieces[j]
    if apply:
        tok[:] = new_tok
        calls[:] = new_calls
    return layer_seconds(new_tok, new_calls, alpha, call_overhead, beta)


@compiled
def route_check(load, expert, gpu, share, num_gpus, alpha, call_overhead, beta):
    """A layer's serial time on its actual loads, the three numbers the data plane chooses its
    shares by: planned (the plan's shares), unsplit (each expert's tokens all on its first
    replica: static EP's split for moeless's plans, whose home replicas come first) and floor, the
    least any split of the same replicas can reach, so a re-level saves at most
    min(planned, unsplit) - floor. floor is the largest of:
    1. the unsplit experts' time alone (a re-level moves only the tokens of experts with several
       replicas, so whatever GPU the unsplit ones make busiest stays at least that busy);
    2. the work spread evenly (every token once, every expert with tokens called at least once);
    3. per split expert, its tokens alone spread over its GPUs on top of their unsplit experts: on
       the k GPUs it uses, the busiest is at least their mean (k calls and its tokens added) and at
       least the k-th least busy of them plus a call; the least of that over k.

    load: [E] whole tokens per expert (int); expert, gpu, share: [R] the layer's replicas, whose
    tokens are whole (`largest_remainder`, as routed) -> (planned_s, unsplit_s, floor_s,
    unsplit_share [R]: 1 on each expert's first replica).
    """
    n, num_experts = expert.shape[0], load.shape[0]
    routed = largest_remainder(load, expert, share)
    copies = np.zeros(num_experts, np.int64)
    first = np.full(num_experts, -1, np.int64)
    unsplit_share = np.zeros(n)
    for r in range(n):
        copies[expert[r]] += 1
        if first[expert[r]] < 0:
            first[expert[r]] = r
            unsplit_share[r] = 1.0
    tok, calls = np.zeros(num_gpus, np.int64), np.zeros(num_gpus, np.int64)
    fixed_tok, fixed_calls = np.zeros(num_gpus, np.int64), np.zeros(num_gpus, np.int64)
    one_tok, one_calls = np.zeros(num_gpus, np.int64), np.zeros(num_gpus, np.int64)
    total, called = 0, 0
    for e in range(num_experts):
        total += load[e]
        if load[e] > 0:
            called += 1
            one_tok[gpu[first[e]]] += load[e]
            one_calls[gpu[first[e]]] += 1
    for r in range(n):
        t = routed[r]
        if t <= 0:
            continue
        tok[gpu[r]] += t
        calls[gpu[r]] += 1
        if copies[expert[r]] == 1:
            fixed_tok[gpu[r]] += t
            fixed_calls[gpu[r]] += 1
    planned = layer_seconds(tok, calls, alpha, call_overhead, beta)
    unsplit = layer_seconds(one_tok, one_calls, alpha, call_overhead, beta)
    spread = (alpha * total + call_overhead * called + 2.0 * beta * total) / num_gpus
    floor = max(layer_seconds(fixed_tok, fixed_calls, alpha, call_overhead, beta), spread)
    busy = (alpha + 2.0 * beta) * fixed_tok + call_overhead * fixed_calls
    theirs = np.empty(n)
    for e in range(num_experts):
        if copies[e] < 2 or load[e] <= 0:
            continue
        m = 0
        for r in range(n):
            if expert[r] == e:  # insertion sort: an expert has a few replicas
                j = m
                while j > 0 and theirs[j - 1] > busy[gpu[r]]:
                    theirs[j] = theirs[j - 1]
                    j -= 1
                theirs[j] = busy[gpu[r]]
                m += 1
        best, summed = np.inf, 0.0
        for k in range(1, m + 1):
            summed += theirs[k - 1]
            mean = (summed + (alpha + 2.0 * beta) * load[e] + k * call_overhead) / k
            best = min(best, max(mean, theirs[k - 1] + call_overhead))
        floor = max(floor, best)
    return planned, unsplit, floor, unsplit_share
