"""Scatter and gather of one MoE layer's tokens over expert hosts: pure functions over tensors.

Scatter: the gate chose experts idx: [T, k]; each expert's tokens are listed in token order and
cut into consecutive chunks, one per replica, of the whole sizes LayerPlacement.replica_tokens
gives (its share of the expert's tokens). A host receives one routed call (expert_fn/wire/routed.py):
each token it needs once, and its (token, expert, gate weight) pairs expert-major, so one call
per host per layer carries everything. All of it is a few vectorised array ops per layer.

Combine: the in-process reference (LocalExecutor) adds a token's weighted expert outputs in
ascending expert order, from zeros. A host adds up the pairs that begin a token's list (its
first experts in that order, all on this host) into one output row: the reference's own partial
sum, so one row comes back for them; every other pair gets an output row of its own. Each output
row has a combine rank (the rank of its first expert among the token's k, ascending), and a
host's rows are numbered rank-major, so each rank's rows are one slice of its answer. Gather
copies each token's rank-0 row and adds the later ranks in order (one index_add_ per rank and
host), so the result equals the reference forward bit for bit when the expert outputs do. With
static EP's contiguous blocks over 2 hosts and k=8 of 16 experts, a token crosses the wire about
7 times instead of 16 (once to each host, once back from the first, 4 single rows). Hosts on
shared memory combine too: measured, the adds cost them less than the rows saved cost gather.

Chunks are whole and never smaller than MIN_CHUNK rows unless the expert has fewer tokens than
that (then one replica takes them all): CPU BLAS (MKL sgemm, measured here) computes batches of
1-3 rows with other kernels than larger ones, which round differently. For experts of 192
neurons every batch of 4 or more rows gave each row bit-identical results, so split experts
matched the reference exactly; for 48-neuron experts some larger row counts round differently
too (measured), and a split expert matches only up to float rounding. An expert kept in one
chunk (every static placement) always matches bit for bit, so where the hosts' kernel is not
split-exact (hardware/host_profile.split_exact, probed on a host) the executor plans with
min_chunk=None: every expert's tokens go to one replica, its largest chunk's.

Replica i lives on host `placement.gpu[i]`: GPU ids of a placement are expert-host indices.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import numpy as np
import torch

from moeless.controller.pool.members import NoLiveHostError
from moeless.expert_fn.wire.routed import RoutedCall
from moeless.placement.types import LayerPlacement

MIN_CHUNK = 4  # rows; see the module docstring
WHOLE = np.iinfo(np.int64).max  # a chunk size no part reaches: merge_small_chunks keeps experts whole


@dataclass(frozen=True)
class HostBatch:
    """One host's routed call for one layer (tokens: the token index of each row sent, ascending;
    pairs expert-major, experts ascending)."""

    call: RoutedCall

    @property
    def experts(self) -> list[int]:
        return self.call.experts

    @property
    def counts(self) -> list[int]:
        return self.call.counts


class Group(NamedTuple):  # a tuple: a decode step makes ~k * hosts of them per layer
    """Output rows of one host that land in one combine rank: rows (a slice of the host's z) hold,
    in order, the rank-`rank` term of `tokens` (long, distinct)."""

    rank: int
    host: int
    rows: slice
    tokens: torch.Tensor


@dataclass(frozen=True)
class ScatterPlan:
    """Where every routed token of one layer goes: tokens T, k choices each, host -> HostBatch;
    groups: every host's output rows by combine rank, ranks ascending (what gather adds, in order)."""

    tokens: int
    k: int
    hosts: dict[int, HostBatch]
    groups: list[Group]

    def tokens_per_host(self) -> dict[int, int]:
        """Pairs (token, expert) each host computes."""
        return {h: b.call.pairs for h, b in self.hosts.items()}


def plan_scatter(layer: int, idx: torch.Tensor, weight: torch.Tensor, placement: LayerPlacement,
                 min_chunk: int | None = MIN_CHUNK) -> ScatterPlan:
    """Split each expert's tokens over its replicas and make one routed call per host (array
    methods, not np.* wrappers: a decode step's arrays are tiny and each wrapper costs ~3 us).

    idx: [T, k] long expert choices; weight: [T, k] their gate weights (in the dtype the tokens
    travel in); placement: the layer's replicas (expert, gpu, share); min_chunk: the fewest rows a
    part of a split expert gets (None: experts are never split; module docstring).
    """
    tokens, k = idx.shape
    num_experts = int(placement.expert.max()) + 1 if placement.num_replicas else 0
    choice = idx.numpy()  # numpy: a decode step's arrays are tiny, and torch's per-op cost would dominate
    if choice.size and int(choice.max()) >= num_experts:
        raise ValueError(f"the gate chose expert {int(choice.max())} but the placement has only {num_experts} experts")
    # 1. Every (token, slot) in expert-major order, tokens ascending within an expert (the order
    #    the reference walks them); each one's combine slot: its expert's rank within the token.
    flat_idx = choice.reshape(-1)
    order = flat_idx.argsort(kind="stable")
    rank = np.empty_like(choice)
    token_of_row = np.arange(tokens)[:, None]
    rank[token_of_row, choice.argsort(axis=1)] = np.arange(k)
    dest = (token_of_row * k + rank).reshape(-1)[order]
    load = np.bincount(flat_idx, minlength=num_experts)
    # 2. Whole token counts per replica from each replica's share; chunks of >= MIN_CHUNK rows.
    expert, gpu = placement.expert, placement.gpu
    if placement.num_replicas == num_experts:  # one replica per expert: its chunk is the expert's rows
        counts = load[expert]
    else:
        counts = merge_small_chunks(expert, placement.replica_tokens(load), WHOLE if min_chunk is None else min_chunk)
        if not np.array_equal(np.bincount(expert, weights=counts, minlength=num_experts), load):
            raise ValueError("the placement's shares do not route every token (an expert's shares must sum to 1)")
    # 3. Consecutive chunks per replica, an expert's replicas in index order: the host of every
    #    pair of `order` (expert-major), so a host's pairs, taken in order, list its experts ascending.
    by_expert = expert.argsort(kind="stable")
    host_of_pair = np.repeat(gpu[by_expert], counts[by_expert])
    # 4. Output rows: the pairs that begin a token's experts on one host share the first one's slot.
    host_by_slot = np.empty(tokens * k, dtype=np.int64)
    host_by_slot[dest] = host_of_pair
    by_rank = host_by_slot.reshape(tokens, k)
    prefix = (by_rank == by_rank[:, :1]).cumprod(axis=1).astype(bool)
    # Each pair's output row, named rank-major (rank * T + token): a combined pair takes its row's rank 0.
    rank_major = (np.arange(k) * tokens + token_of_row).reshape(-1)
    slot_of_output = np.where(prefix.reshape(-1), np.repeat(np.arange(tokens), k), rank_major)[dest]
    rank_starts = np.arange(k + 1) * tokens
    # The weights picked in numpy as raw bits of their width (numpy has no bfloat16; a pick is exact).
    bits = {2: torch.int16, 4: torch.int32, 8: torch.int64}[weight.element_size()]
    flat_weight = weight.contiguous().view(bits).numpy().reshape(-1)
    hosts, groups = {}, []
    for h in np.bincount(host_of_pair).nonzero()[0].tolist():  # bincount, not unique: faster on tiny arrays
        positions = (host_of_pair == h).nonzero()[0]
        flat = order[positions]
        pairs_per_expert = np.bincount(flat_idx[flat], minlength=num_experts)
        experts = pairs_per_expert.nonzero()[0]
        rows, src = _numbered(flat // k, tokens)
        # Output rows numbered rank-major (rank, then token): each rank's rows are one slice of z.
        key, out = _numbered(slot_of_output[positions], tokens * k)
        bounds = np.searchsorted(key, rank_starts).tolist()
        token = torch.from_numpy(key % tokens)
        groups += [Group(r, h, slice(a, b), token[a:b]) for r, (a, b) in enumerate(zip(bounds, bounds[1:])) if b > a]
        call = RoutedCall(layer, experts.tolist(), pairs_per_expert[experts].tolist(), torch.from_numpy(rows),
                          torch.from_numpy(src.astype(np.int32)), torch.from_numpy(out.astype(np.int32)),
                          torch.from_numpy(flat_weight[flat]).view(weight.dtype), len(key))
        hosts[h] = HostBatch(call)
    groups.sort(key=lambda g: g.rank)
    return ScatterPlan(tokens, k, hosts, groups)


def _numbered(values: np.ndarray, size: int) -> tuple[np.ndarray, np.ndarray]:
    """(the distinct values ascending, each value's index among them): np.unique's answer for
    values in [0, size), by a mask (a sort costs more on a decode step's few values)."""
    seen = np.zeros(size, dtype=bool)
    seen[values] = True
    number = seen.cumsum() - 1
    return seen.nonzero()[0], number[values]


def merge_small_chunks(expert: np.ndarray, counts: np.ndarray, min_rows: int) -> np.ndarray:
    """Move every chunk of fewer than min_rows tokens to its expert's largest chunk.

    expert: [R] expert of each replica; counts: [R] tokens per replica -> [R], same per-expert sums;
    afterwards each expert has either one non-empty chunk or only chunks of >= min_rows.
    """
    counts = counts.copy()
    chunks = np.bincount(expert, weights=counts > 0)
    for e in np.flatnonzero(chunks > 1):  # only split experts have chunks to merge (a Python loop per expert: ~8 us)
        idx = np.flatnonzero(expert == e)
        while True:
            live = idx[counts[idx] > 0]
            small = live[counts[live] < min_rows]
            if live.size <= 1 or small.size == 0:
                break
            # 1. The smallest chunk joins the largest other chunk (ties: lower replica index).
            donor = small[np.argmin(counts[small])]  # argmin and argmax return the first of ties
            others = live[live != donor]
            taker = others[np.argmax(counts[others])]
            counts[taker] += counts[donor]
            counts[donor] = 0
    return counts


def gather(plan: ScatterPlan, outputs: dict[int, torch.Tensor], hidden: int, dtype: torch.dtype,
           device: torch.device | str = "cpu") -> torch.Tensor:
    """Combine the hosts' answers: outputs: host -> z [n_out, H] (its routed call's output rows, on
    `device`) -> [T, H] on `device`: each token's rank-0 row copied, then its later ranks added in
    rank order (ascending expert), as the reference adds them (from zeros: 0 + a is a). Every token
    has one rank-0 row."""
    out = torch.empty((plan.tokens, hidden), dtype=dtype, device=device)
    on_cpu = out.device.type == "cpu"  # the plan's token lists are in host memory
    for g in plan.groups:  # ranks ascending; within a rank the hosts' tokens are distinct
        rows = outputs[g.host][g.rows]
        tokens = g.tokens if on_cpu else g.tokens.to(out.device, non_blocking=True)
        if g.rank == 0:
            out.index_copy_(0, tokens, rows)
        else:
            out.index_add_(0, tokens, rows)
    return out


def evacuate(placement: LayerPlacement, dead: set[int], num_hosts: int) -> LayerPlacement:
    """Move the replicas held by dead hosts onto live ones (fault handling, not planning).

    Each moved replica goes to the live host with the fewest replicas of this layer (ties: the
    lower index), keeping its expert and share, so every expert keeps its full share of tokens;
    two replicas of an expert that land on one host become one with both shares (per-call
    re-levelling assumes one replica per (expert, host)). Raises NoLiveHostError when every host
    is dead.
    """
    live = [h for h in range(num_hosts) if h not in dead]
    if not live:
        raise NoLiveHostError(f"all {num_hosts} expert hosts are down; restart them (`moeless expert-host`)")
    gpu = placement.gpu.copy()
    held = np.bincount(gpu[~np.isin(gpu, list(dead))], minlength=num_hosts)
    for r in np.flatnonzero(np.isin(gpu, list(dead))):
        target = min(live, key=lambda h: (held[h], h))
        gpu[r] = target
        held[target] += 1
    pairs, first, inverse = np.unique(np.stack([placement.expert, gpu]), axis=1, return_index=True, return_inverse=True)
    if pairs.shape[1] == gpu.shape[0]:
        return LayerPlacement(placement.expert, gpu, placement.share)
    keep = np.sort(first)  # the replicas' order kept: the first of each (expert, host)
    share = np.bincount(inverse.reshape(-1), weights=placement.share, minlength=pairs.shape[1])
    rank = np.empty(pairs.shape[1], dtype=np.int64)
    rank[np.argsort(first)] = np.arange(pairs.shape[1])
    merged = np.empty(pairs.shape[1])
    merged[rank] = share
    return LayerPlacement(placement.expert[keep], gpu[keep], merged)
