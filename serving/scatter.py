"""Scatter and gather of one MoE layer's tokens over expert hosts: pure functions over tensors.

Scatter: the gate chose experts idx: [T, k]; each expert's tokens are listed in token order and
cut into consecutive chunks, one per replica, of the whole sizes LayerPlacement.replica_tokens
gives (its share of the expert's tokens). A host receives one packed batch: the rows of every
chunk it holds, expert-major (expert_fn/packed.py), so one call per host per layer carries
everything. All of it is a few vectorised tensor ops per layer (one argsort, one index per host).

Gather: each output row, times its gate weight, goes to its token's combine slot, and each
token's k slots are added in ascending expert order, the order of the in-process reference
(LocalExecutor), so the result equals the reference forward bit for bit when the expert
outputs do.

Chunks are whole and never smaller than MIN_CHUNK rows unless the expert has fewer tokens than
that (then one replica takes them all): CPU BLAS (MKL sgemm, measured here) computes batches of
1-3 rows with other kernels than larger ones, which round differently. For experts of 192
neurons every batch of 4 or more rows gave each row bit-identical results, so split experts
matched the reference exactly; for 48-neuron experts some larger row counts round differently
too (measured), and a split expert matches only up to float rounding. An expert kept in one
chunk (every static placement) always matches bit for bit.

Replica i lives on host `placement.gpu[i]`: GPU ids of a placement are expert-host indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeless.controller.pool.members import NoLiveHostError
from moeless.placement.types import LayerPlacement

MIN_CHUNK = 4  # rows; see the module docstring


@dataclass(frozen=True)
class HostBatch:
    """One host's packed call for one layer.

    experts: ascending, each with >= 1 row; counts: rows per expert; rows: [n] long, the token
    index of each row (the host gets x[rows], expert-major); dest: [n] long, the flat combine slot
    t * k + r of each row's output (r: the expert's rank among token t's k experts, ascending);
    flat: [n] long, the row's index into idx.reshape(-1) (its gate weight).
    """

    experts: list[int]
    counts: list[int]
    rows: torch.Tensor
    dest: torch.Tensor
    flat: torch.Tensor


@dataclass(frozen=True)
class ScatterPlan:
    """Where every routed token of one layer goes: tokens T, k choices each, host -> HostBatch."""

    tokens: int
    k: int
    hosts: dict[int, HostBatch]

    def tokens_per_host(self) -> dict[int, int]:
        return {h: int(b.rows.numel()) for h, b in self.hosts.items()}


def plan_scatter(idx: torch.Tensor, placement: LayerPlacement) -> ScatterPlan:
    """Split each expert's tokens over its replicas and pack them by host.

    idx: [T, k] long expert choices; placement: the layer's replicas (expert, gpu, share).
    """
    tokens, k = idx.shape
    num_experts = int(placement.expert.max()) + 1 if placement.num_replicas else 0
    choice = idx.numpy()  # numpy: a decode step's arrays are tiny, and torch's per-op cost would dominate
    if choice.size and int(choice.max()) >= num_experts:
        raise ValueError(f"the gate chose expert {int(choice.max())} but the placement has only {num_experts} experts")
    # 1. Every (token, slot) in expert-major order, tokens ascending within an expert (the order
    #    the reference walks them); each one's combine slot: its expert's rank within the token.
    flat_idx = choice.reshape(-1)
    order = np.argsort(flat_idx, kind="stable")
    rank = np.empty_like(choice)
    np.put_along_axis(rank, np.argsort(choice, axis=1), np.arange(k)[None, :], axis=1)
    dest = (np.arange(tokens)[:, None] * k + rank).reshape(-1)[order]
    load = np.bincount(flat_idx, minlength=num_experts)
    # 2. Whole token counts per replica from each replica's share; chunks of >= MIN_CHUNK rows.
    expert, gpu = placement.expert, placement.gpu
    if placement.num_replicas == num_experts:  # one replica per expert: its chunk is the expert's rows
        counts = load[expert]
    else:
        counts = merge_small_chunks(expert, placement.replica_tokens(load), MIN_CHUNK)
        if not np.array_equal(np.bincount(expert, weights=counts, minlength=num_experts), load):
            raise ValueError("the placement's shares do not route every token (an expert's shares must sum to 1)")
    # 3. Consecutive chunks per replica, an expert's replicas in index order: the host of every
    #    row of `order` (expert-major), so a host's rows, taken in order, list its experts ascending.
    by_expert = np.argsort(expert, kind="stable")
    host_of_row = np.repeat(gpu[by_expert], counts[by_expert])
    hosts = {}
    for h in np.flatnonzero(np.bincount(host_of_row)).tolist():  # bincount, not unique: faster on tiny arrays
        positions = np.flatnonzero(host_of_row == h)
        flat = order[positions]
        rows_per_expert = np.bincount(flat_idx[flat], minlength=num_experts)
        experts = np.flatnonzero(rows_per_expert)
        hosts[h] = HostBatch(experts.tolist(), rows_per_expert[experts].tolist(), torch.from_numpy(flat // k),
                             torch.from_numpy(dest[positions]), torch.from_numpy(flat))
    return ScatterPlan(tokens, k, hosts)


def merge_small_chunks(expert: np.ndarray, counts: np.ndarray, min_rows: int) -> np.ndarray:
    """Move every chunk of fewer than min_rows tokens to its expert's largest chunk.

    expert: [R] expert of each replica; counts: [R] tokens per replica -> [R], same per-expert sums;
    afterwards each expert has either one non-empty chunk or only chunks of >= min_rows.
    """
    counts = counts.copy()
    for e in np.unique(expert):
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


def host_inputs(plan: ScatterPlan, x: torch.Tensor) -> dict[int, torch.Tensor]:
    """The packed rows each host gets: host -> x[rows]: [n, H] (transports copy them themselves)."""
    return {h: x.index_select(0, b.rows) for h, b in plan.hosts.items()}


def gather(plan: ScatterPlan, outputs: dict[int, torch.Tensor], weight: torch.Tensor) -> torch.Tensor:
    """Combine the hosts' packed outputs with the gate weights.

    outputs: host -> y: [n, H] (row for row of its HostBatch); weight: [T, k] -> [T, H],
    sum_j weight[t, j] * expert(idx[t, j])(x[t]), summed over each token's experts in ascending
    expert order starting from the lowest: the reference's order, so the sums round the same.
    """
    tokens, k = plan.tokens, plan.k
    if not plan.hosts:
        return weight.new_zeros((tokens, 0))
    hidden = next(iter(outputs.values())).shape[-1]
    # 1. Each output, times its gate weight, into its combine slot [T * k, H].
    flat_weight = weight.reshape(-1)
    slots = weight.new_empty((tokens * k, hidden))
    for h, batch in plan.hosts.items():
        slots.index_copy_(0, batch.dest, outputs[h] * flat_weight.index_select(0, batch.flat).unsqueeze(1))
    # 2. Per token, the k slots added in rank order.
    slots = slots.view(tokens, k, hidden)
    out = slots[:, 0].clone()
    for r in range(1, k):
        out += slots[:, r]
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
