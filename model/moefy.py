"""MoEfication of one dense SwiGLU FFN: split its neurons into E experts and train a router.

Pure functions over tensors (no model, no I/O). Shapes: T calibration tokens, H hidden size,
N the dense FFN's neurons, E experts, F = N / E neurons per expert.

Method (after Zhang et al., "MoEfication: Transformer Feed-forward Layers are Mixtures of
Experts", 2022, adapted to SwiGLU, with a shared expert as in DeepSeek-MoE and Qwen2-MoE):
1. A neuron's activation on a token is the size of its contribution to the FFN output,
   |silu(gate x) * up x| * ||down column||; per token, the top `active_fraction` are "active".
   The S neurons with the largest mean activation form the shared expert (run on every
   token); the remaining N - S are split into the routed experts (steps 2-3).
2. Co-activation: how often two neurons are active on the same token, cosine-normalised so
   that always-on neurons do not attract everything.
3. Balanced clustering: E equal-size groups that maximise the mean co-activation between a
   neuron and its group (a balanced k-means over the co-activation graph).
4. Router: a linear gate [E, H] fitted on the FFN inputs to rank the experts by the norm of
   their output on each token, so that top-k picks the experts carrying the most activation.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F


@dataclass(frozen=True)
class MoefyConfig:
    """Knobs of the conversion (defaults measured on SmolLM2-135M, see docs/model.md)."""

    active_fraction: float = 0.1  # share of neurons counted as active per token
    cluster_iters: int = 15  # balanced k-means rounds (stops earlier when stable)
    router_ridge: float = 1e-2  # L2 penalty of the router regression (inputs at unit variance)


def ffn_hidden(x: torch.Tensor, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """The SwiGLU FFN's neuron values silu(x gate^T) * (x up^T).

    x: [T, H]; gate: [N, H]; up: [N, H] -> h: [T, N].
    """
    return F.silu(x @ gate.T) * (x @ up.T)


def neuron_activations(h: torch.Tensor, down: torch.Tensor) -> torch.Tensor:
    """Contribution size of each neuron on each token: |h[t, n]| * ||down[:, n]||.

    h: [T, N] neuron values; down: [H, N] -> [T, N].
    """
    return h.abs() * down.norm(dim=0)


def shared_neurons(acts: torch.Tensor, size: int) -> torch.Tensor:
    """The `size` neurons with the largest mean activation: the always-on shared expert.

    acts: [T, N] -> [size] long, ascending. Without it, these "hot" neurons land in one routed
    expert that nearly every token picks (docs/model.md).
    """
    n = acts.shape[1]
    if not 0 <= size < n:
        raise ValueError(f"shared expert size must be in 0..{n - 1} neurons, got {size}")
    return acts.mean(dim=0).topk(size).indices.sort().values


def routed_neurons(num_neurons: int, shared: torch.Tensor) -> torch.Tensor:
    """The neurons not in the shared expert: [N - S] long, ascending."""
    keep = torch.ones(num_neurons, dtype=torch.bool)
    keep[shared] = False
    return keep.nonzero().flatten()


def coactivation(acts: torch.Tensor, active_fraction: float) -> torch.Tensor:
    """Cosine-normalised co-activation counts of neurons.

    acts: [T, N] -> [N, N], entry (n, m) = |active(n) & active(m)| / sqrt(|active(n)| |active(m)|).
    """
    if not 0 < active_fraction <= 1:
        raise ValueError(f"active_fraction must be in (0, 1], got {active_fraction}")
    # 1. Per token, mark the top share of neurons as active.
    n_active = max(1, round(active_fraction * acts.shape[1]))
    top = acts.topk(n_active, dim=1).indices
    active = torch.zeros_like(acts).scatter_(1, top, 1.0)
    # 2. Count co-activations and normalise by each neuron's own count.
    counts = active.T @ active
    scale = counts.diagonal().clamp_min(1.0).rsqrt()
    return counts * scale[:, None] * scale[None, :]


def balanced_clusters(similarity: torch.Tensor, num_groups: int, seed: int, iters: int = 15) -> torch.Tensor:
    """Split N items into num_groups equal groups of mutually similar items.

    similarity: [N, N] symmetric, larger = more alike -> groups: [E, N / E] long, item ids
    ascending within each group, groups ordered by their smallest item.
    """
    n = similarity.shape[0]
    if num_groups < 1 or n % num_groups:
        raise ValueError(f"{n} neurons do not split into {num_groups} equal experts; pick E dividing {n}")
    size = n // num_groups
    gen = torch.Generator().manual_seed(seed)
    # 1. Seeds: a random first item, then each next the item least similar to the seeds so far.
    seeds = [int(torch.randint(n, (1,), generator=gen))]
    for _ in range(1, num_groups):
        closeness = similarity[:, seeds].max(dim=1).values
        closeness[seeds] = float("inf")
        seeds.append(int(closeness.argmin()))
    score = similarity[:, seeds]  # [N, E]: affinity of each item to each group
    assign = _assign_balanced(score, size)
    for _ in range(iters):
        # 2. Affinity to a group = mean similarity to its members; 3. reassign under equal sizes.
        members = F.one_hot(assign, num_groups).to(similarity.dtype)
        score = similarity @ members / size
        new = _assign_balanced(score, size)
        if torch.equal(new, assign):
            break
        assign = new
    groups = [torch.nonzero(assign == g).flatten() for g in range(num_groups)]
    groups.sort(key=lambda g: int(g[0]))
    return torch.stack(groups)


def _assign_balanced(score: torch.Tensor, size: int) -> torch.Tensor:
    """Greedy capacity-constrained assignment: best (item, group) pairs first, each group takes `size`.

    score: [N, E] -> assign: [N] long group ids.
    """
    n, e = score.shape
    order = torch.argsort(score.flatten(), descending=True, stable=True).tolist()
    assign = [-1] * n
    room = [size] * e
    left = n
    for flat in order:
        item, group = divmod(flat, e)
        if assign[item] < 0 and room[group]:
            assign[item] = group
            room[group] -= 1
            left -= 1
            if not left:
                break
    return torch.tensor(assign)


def expert_output_norms(h: torch.Tensor, down: torch.Tensor, groups: torch.Tensor) -> torch.Tensor:
    """||output of expert e on token t||, where expert e is the neurons groups[e] of the FFN.

    h: [T, N] neuron values; down: [H, N]; groups: [E, F] -> [T, E].
    """
    out = torch.einsum("tef,hef->teh", h[:, groups], down[:, groups])  # [T, E, H]
    return out.norm(dim=-1)


def train_router(x: torch.Tensor, mass: torch.Tensor, cfg: MoefyConfig = MoefyConfig()) -> torch.Tensor:
    """A linear gate whose logits rank the experts by their output mass on each token.

    Ridge regression of the log expert-output norms on the FFN inputs, in closed form: as fast
    as a few gradient steps and, on SmolLM2, better at picking the true top-k (docs/model.md).
    x: [T, H] FFN inputs; mass: [T, E] expert output norms -> router weight [E, H].
    """
    x, mass = x.detach().double(), mass.detach().double()
    # 1. Target: log output norm, centred per token (top-k ignores a per-token shift).
    target = mass.clamp_min(1e-6).log()
    target = target - target.mean(dim=1, keepdim=True)
    # 2. Scale inputs to unit variance so that one ridge penalty suits every feature; the scale
    #    folds into the weights. No centring and no bias: the gate is bias-free, like Mixtral's.
    scale = x.std(dim=0).clamp_min(1e-6).reciprocal()
    z = x * scale
    # 3. Solve (Z^T Z / T + lambda I) W^T = Z^T Y / T.
    t, h = z.shape
    gram = z.T @ z / t + cfg.router_ridge * torch.eye(h, dtype=z.dtype)
    weight = torch.linalg.solve(gram, z.T @ target / t).T
    return (weight * scale).float().contiguous()
