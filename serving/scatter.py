"""Scatter and gather of one MoE layer's tokens over expert hosts: pure functions over tensors.

Scatter: the gate chose experts idx: [T, k]; each expert's tokens are listed in token order and
cut into consecutive chunks, one per replica, of the whole sizes LayerPlacement.replica_tokens
gives (its share of the expert's tokens). A host receives, per expert, the concatenation of the
chunks of the replicas it holds, so one invocation per host per layer carries everything.

Gather: each expert's outputs are put back in token order and combined with the gate weights
expert by expert, in the same order as the in-process reference (LocalExecutor), so the result
equals the reference forward up to float rounding inside the expert matmuls.

Chunks are whole and never smaller than MIN_CHUNK rows unless the expert has fewer tokens than
that (then one replica takes them all): CPU BLAS (MKL sgemm, measured here) computes batches of
1-3 rows with other kernels than larger ones, which round differently, while every batch of 4 or
more rows gives each row bit-identical results. Keeping chunks that large makes the serving
path's expert outputs identical to the reference's for any placement.

Replica i lives on host `placement.gpu[i]`: GPU ids of a placement are expert-host indices.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

from moeless.placement.types import LayerPlacement

MIN_CHUNK = 4  # rows; see the module docstring


class NoLiveHostError(RuntimeError):
    """Every expert host is down: the layer cannot run anywhere."""


@dataclass(frozen=True)
class ExpertTokens:
    """The tokens routed to one expert, in token order.

    rows: [N] long, token index t; slots: [N] long, which of the token's k choices it was.
    """

    rows: torch.Tensor
    slots: torch.Tensor


@dataclass(frozen=True)
class ScatterPlan:
    """Where every routed token of one layer goes.

    experts: expert -> its ExpertTokens (experts with no token are absent);
    hosts: host -> expert -> [n] long positions into experts[e].rows (that host's chunks).
    """

    experts: dict[int, ExpertTokens]
    hosts: dict[int, dict[int, torch.Tensor]]

    def tokens_per_host(self) -> dict[int, int]:
        return {h: int(sum(p.numel() for p in batch.values())) for h, batch in self.hosts.items()}


def plan_scatter(idx: torch.Tensor, placement: LayerPlacement) -> ScatterPlan:
    """Split each expert's tokens over its replicas and group them by host.

    idx: [T, k] long expert choices; placement: the layer's replicas (expert, gpu, share).
    """
    # 1. Each expert's tokens in token order (row-major over [T, k], as the reference walks them).
    num_experts = int(placement.expert.max()) + 1 if placement.num_replicas else 0
    if idx.numel() and int(idx.max()) >= num_experts:
        raise ValueError(f"the gate chose expert {int(idx.max())} but the placement has only {num_experts} experts")
    experts: dict[int, ExpertTokens] = {}
    for e in torch.unique(idx).tolist():
        rows, slots = torch.where(idx == e)
        experts[e] = ExpertTokens(rows, slots)
    # 2. Whole token counts per replica from each replica's share.
    load = np.zeros(num_experts, dtype=np.int64)
    for e, tokens in experts.items():
        load[e] = tokens.rows.numel()
    counts = merge_small_chunks(placement.expert, placement.replica_tokens(load), MIN_CHUNK)
    # 3. Consecutive chunks per replica, appended to the replica's host batch.
    offset = np.zeros(num_experts, dtype=np.int64)
    chunks: dict[int, dict[int, list[torch.Tensor]]] = {}
    for r in range(placement.num_replicas):
        e, n = int(placement.expert[r]), int(counts[r])
        if n == 0:
            continue
        start = int(offset[e])
        offset[e] += n
        chunks.setdefault(int(placement.gpu[r]), {}).setdefault(e, []).append(torch.arange(start, start + n))
    hosts = {h: {e: torch.cat(parts) for e, parts in sorted(batch.items())} for h, batch in sorted(chunks.items())}
    return ScatterPlan(experts, hosts)


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


def host_inputs(plan: ScatterPlan, x: torch.Tensor) -> dict[int, dict[int, torch.Tensor]]:
    """The token batches to send: host -> expert -> [n, H] rows of x: [T, H]."""
    return {
        h: {e: x[plan.experts[e].rows[pos]].contiguous() for e, pos in batch.items()}
        for h, batch in plan.hosts.items()
    }


def gather(plan: ScatterPlan, outputs: dict[int, dict[int, torch.Tensor]], weight: torch.Tensor,
           num_tokens: int) -> torch.Tensor:
    """Combine the hosts' expert outputs with the gate weights.

    outputs: host -> expert -> [n, H] (the answers to host_inputs); weight: [T, k] -> [T, H],
    sum_j weight[t, j] * expert(idx[t, j])(x[t]).
    """
    # 1. Reassemble each expert's outputs in token order.
    per_expert: dict[int, torch.Tensor] = {}
    for h, batch in plan.hosts.items():
        for e, pos in batch.items():
            y = outputs[h][e]
            if e not in per_expert:
                per_expert[e] = y.new_empty((plan.experts[e].rows.numel(), y.shape[-1]))
            per_expert[e][pos] = y
    # 2. Weighted sum, expert by expert in ascending order (the reference's order).
    hidden = next(iter(per_expert.values())).shape[-1] if per_expert else 0
    out = weight.new_zeros((num_tokens, hidden))
    for e in sorted(per_expert):
        tokens = plan.experts[e]
        out.index_add_(0, tokens.rows, per_expert[e] * weight[tokens.rows, tokens.slots, None])
    return out


def evacuate(placement: LayerPlacement, dead: set[int], num_hosts: int) -> LayerPlacement:
    """Move the replicas held by dead hosts onto live ones (fault handling, not planning).

    Each moved replica goes to the live host with the fewest replicas of this layer (ties: the
    lower index), keeping its expert and share, so every expert keeps its full share of tokens.
    Raises NoLiveHostError when every host is dead.
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
    return LayerPlacement(placement.expert, gpu, placement.share)
