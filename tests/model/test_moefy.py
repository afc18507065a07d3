"""Unit tests of the MoEfication policies (model/moefy.py) on small synthetic tensors."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moeless.model.moefy import (
    balanced_clusters,
    coactivation,
    expert_output_norms,
    ffn_hidden,
    neuron_activations,
    routed_neurons,
    shared_neurons,
    train_router,
)


def _ffn(n: int = 24, h: int = 8, seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    return torch.randn(n, h, generator=gen), torch.randn(n, h, generator=gen), torch.randn(h, n, generator=gen)


def _planted_similarity(groups: int, size: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Similarity with `groups` hidden blocks under a random relabelling: (similarity [N, N], block of each item [N])."""
    n = groups * size
    gen = torch.Generator().manual_seed(seed)
    block = torch.randperm(n, generator=gen) % groups
    noise = torch.rand(n, n, generator=gen) * 0.3
    sim = (block[:, None] == block[None, :]).float() + (noise + noise.T) / 2
    return sim, block


def test_ffn_hidden_and_neuron_activations_are_contribution_sizes():
    gate, up, down = _ffn()
    x = torch.randn(5, 8)
    h = ffn_hidden(x, gate, up)
    torch.testing.assert_close(h, F.silu(x @ gate.T) * (x @ up.T))
    acts = neuron_activations(h, down)
    # The contribution of neuron n is h[:, n] * down[:, n]; its norm is the activation.
    contrib = h[:, :, None] * down.T[None]
    assert acts.shape == (5, 24)
    torch.testing.assert_close(acts, contrib.norm(dim=-1))


def test_coactivation_counts_shared_activity():
    # Neurons 0 and 1 are always the two largest, neuron 2 never: with 2 of 4 active per token.
    acts = torch.tensor([[5.0, 4.0, 0.0, 1.0], [4.0, 5.0, 0.0, 0.5], [6.0, 3.0, 0.1, 0.2]])
    sim = coactivation(acts, active_fraction=0.5)
    assert sim.shape == (4, 4)
    torch.testing.assert_close(sim, sim.T)
    assert sim[0, 1] == pytest.approx(1.0)
    assert sim[0, 2] == 0.0 and sim[2, 2] == 0.0
    assert sim[0, 3] == 0.0


def test_coactivation_rejects_bad_fraction():
    with pytest.raises(ValueError, match="active_fraction"):
        coactivation(torch.rand(3, 4), active_fraction=0.0)


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_balanced_clusters_recover_planted_groups(seed):
    sim, block = _planted_similarity(groups=4, size=6, seed=seed)
    groups = balanced_clusters(sim, 4, seed=seed)
    assert groups.shape == (4, 6)
    assert sorted(groups.flatten().tolist()) == list(range(24))
    for g in groups:
        assert len(set(block[g].tolist())) == 1, "a group mixes planted blocks"


def test_balanced_clusters_are_deterministic_per_seed():
    gen = torch.Generator().manual_seed(3)
    feats = torch.rand(64, 10, generator=gen)
    sim = feats @ feats.T
    a, b = balanced_clusters(sim, 8, seed=5), balanced_clusters(sim, 8, seed=5)
    assert torch.equal(a, b)
    others = [balanced_clusters(sim, 8, seed=s) for s in range(6, 10)]
    assert any(not torch.equal(a, o) for o in others)


def test_balanced_clusters_need_equal_sizes():
    with pytest.raises(ValueError, match="equal experts"):
        balanced_clusters(torch.eye(10), 4, seed=0)


def test_expert_output_norms_split_the_dense_output():
    gate, up, down = _ffn()
    x = torch.randn(7, 8)
    groups = torch.randperm(24).reshape(4, 6)
    h = ffn_hidden(x, gate, up)
    norms = expert_output_norms(h, down, groups)
    assert norms.shape == (7, 4)
    for e, g in enumerate(groups):
        torch.testing.assert_close(norms[:, e], (h[:, g] @ down[:, g].T).norm(dim=-1))
    # One expert holding every neuron is the dense FFN.
    whole = expert_output_norms(h, down, torch.arange(24)[None])
    torch.testing.assert_close(whole[:, 0], (h @ down.T).norm(dim=-1))


def test_train_router_learns_which_expert_carries_the_mass():
    # Expert e's mass grows with feature e of the input (plus noise), so a linear gate can rank them.
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(4000, 6, generator=gen) + 0.5
    mass = torch.exp(2 * x[:, :4] + 0.1 * torch.randn(4000, 4, generator=gen))
    router = train_router(x, mass)
    assert router.shape == (4, 6)
    top2 = (x @ router.T).topk(2, dim=1).indices.sort(dim=1).values
    true2 = mass.topk(2, dim=1).indices.sort(dim=1).values
    assert (top2 == true2).all(dim=1).float().mean() > 0.9


def test_train_router_is_deterministic():
    gen = torch.Generator().manual_seed(1)
    x, mass = torch.randn(600, 6, generator=gen), torch.rand(600, 3, generator=gen)
    assert torch.equal(train_router(x, mass), train_router(x, mass))


def test_shared_neurons_are_the_most_active_and_the_rest_are_routed():
    # Neuron 3 is large on every token, neuron 0 on most; the others are small or rare.
    acts = torch.tensor([[4.0, 0.1, 0.0, 9.0, 0.2], [3.0, 0.0, 5.0, 8.0, 0.1], [0.0, 0.3, 0.0, 7.0, 0.2]])
    shared = shared_neurons(acts, 2)
    assert shared.tolist() == [0, 3]
    assert routed_neurons(5, shared).tolist() == [1, 2, 4]
    assert shared_neurons(acts, 0).tolist() == [] and routed_neurons(5, shared_neurons(acts, 0)).tolist() == [0, 1, 2, 3, 4]
    with pytest.raises(ValueError, match="shared expert size must be in 0..4"):
        shared_neurons(acts, 5)
