"""Scatter/gather planning and fault evacuation (pure; fake experts are simple functions of x)."""

from types import SimpleNamespace

import numpy as np
import pytest
import torch
from hypothesis import given, settings, strategies as st

from moeless.controller.pool.members import NoLiveHostError
from moeless.placement.types import LayerPlacement
from moeless.expert_fn.wire.routed import RoutedCall, decode_call, encode_call
from moeless.expert_fn.host.run_routed import run_routed
from moeless.serving.scatter import MIN_CHUNK, evacuate, gather, merge_small_chunks, plan_scatter


def _fake_expert(e: int, x: torch.Tensor) -> torch.Tensor:
    return torch.tanh(x * (e + 1)) + e


def _reference(x, idx, weight):
    """LocalExecutor's combine (experts ascending, index_put_ accumulate) with the fake experts."""
    out = torch.zeros_like(x)
    for e in torch.unique(idx).tolist():
        token, slot = (idx == e).nonzero(as_tuple=True)
        out.index_put_((token,), _fake_expert(e, x[token]) * weight[token, slot, None], accumulate=True)
    return out


class _FakeRuntime:
    """An expert host's runtime with the fake experts (what run_routed calls)."""

    device, dtype = "cpu", torch.float32

    def invoke(self, layer, batches, on_device=False, out=None):
        outputs = {e: _fake_expert(e, x) for e, x in batches.items()}
        if out is not None:  # the outputs as out's consecutive slices, as ExpertHostRuntime.invoke
            torch.cat(list(outputs.values()), out=out)
        return SimpleNamespace(outputs=outputs, cold_starts=0, compute_s=0.0)


def _host_outputs(plan, x):
    """What hosts running the fake experts answer to their routed calls (through the wire format)."""
    return {h: run_routed(_FakeRuntime(), decode_call(encode_call(h, b.call, x)))[0] for h, b in plan.hosts.items()}


@st.composite
def layer_cases(draw):
    """A routing idx [T, k] and a random placement (1-3 replicas per expert, uneven shares)."""
    num_experts, k, hosts = draw(st.integers(2, 6)), draw(st.integers(1, 2)), draw(st.integers(1, 4))
    k = min(k, num_experts)
    tokens = draw(st.integers(0, 12))
    rng = np.random.default_rng(draw(st.integers(0, 2**31)))
    idx = torch.tensor(np.stack([rng.choice(num_experts, k, replace=False) for _ in range(tokens)])
                       if tokens else np.zeros((0, k)), dtype=torch.long)
    expert = np.concatenate([np.full(draw(st.integers(1, 3)), e) for e in range(num_experts)])
    gpu = rng.integers(0, hosts, expert.size)
    raw = rng.uniform(0.1, 1.0, expert.size)
    share = raw / np.bincount(expert, weights=raw)[expert]
    return idx, LayerPlacement(expert, gpu, share), hosts


@settings(max_examples=60, deadline=None)
@given(layer_cases())
def test_scatter_then_gather_equals_reference_bit_for_bit(case):
    idx, placement, _ = case
    x = torch.randn(idx.shape[0], 5)
    weight = torch.rand(idx.shape)
    plan = plan_scatter(0, idx, weight, placement)
    out = gather(plan, _host_outputs(plan, x), 5, x.dtype)
    if idx.shape[0]:
        assert torch.equal(out, _reference(x, idx, weight))  # same sums in the same order


@settings(max_examples=60, deadline=None)
@given(layer_cases())
def test_every_token_goes_once_to_a_host_holding_its_expert(case):
    idx, placement, _ = case
    weight = torch.rand(idx.shape)
    plan = plan_scatter(0, idx, weight, placement)
    sent = []  # (token, expert) of every pair
    for h, batch in plan.hosts.items():
        call = batch.call
        assert batch.experts == sorted(batch.experts) and all(c >= 1 for c in batch.counts)
        assert set(batch.experts) <= set(placement.expert[placement.gpu == h].tolist())
        assert call.tokens.tolist() == sorted(set(call.tokens.tolist()))  # each token sent once
        experts = np.repeat(batch.experts, batch.counts)
        tokens = call.tokens[call.src.long()]
        pairs = list(zip(tokens.tolist(), experts.tolist()))
        for (t, e), w in zip(pairs, call.weight.tolist()):
            assert w == weight[t, (idx[t] == e).nonzero().item()].item()
        assert sorted(set(call.out.tolist())) == list(range(call.n_out))
        rows = torch.cat([torch.arange(call.n_out)[g.rows] for g in plan.groups if g.host == h])
        assert sorted(rows.tolist()) == list(range(call.n_out))  # every output row lands once
        sent += pairs
    assert sorted(sent) == sorted((t, int(e)) for t in range(idx.shape[0]) for e in idx[t])
    assert sum(plan.tokens_per_host().values()) == idx.numel()


def test_the_first_experts_of_a_token_on_one_host_come_back_as_one_row():
    """Golden example: token 0 chose experts 0, 1, 3 (host 0 holds 0 and 1, host 1 holds 3); token 1
    chose 1, 2, 3 (2 and 3 on host 1). Host 0 adds token 0's first two experts into one row; host 1
    answers token 1's 2 then 3 in one row only if they begin its list, which they do not (1 comes first)."""
    idx = torch.tensor([[0, 1, 3], [1, 2, 3]])
    placement = LayerPlacement.even(np.arange(4), np.array([0, 0, 1, 1]), 4)
    plan = plan_scatter(0, idx, torch.ones(2, 3), placement)
    host0, host1 = plan.hosts[0], plan.hosts[1]
    assert host0.call.tokens.tolist() == [0, 1] and host1.call.tokens.tolist() == [0, 1]
    assert host0.experts == [0, 1] and host0.counts == [1, 2]
    assert host0.call.out.tolist() == [0, 0, 1]  # token 0's experts 0 and 1 share a row; token 1's 1 is its own
    assert host0.call.n_out == 2 and host1.call.n_out == 3
    assert host1.call.out.tolist() == [0, 1, 2]  # rank-major: token 1 rank 1; then rank 2, tokens 0 and 1
    groups = [(g.rank, g.host, g.rows, g.tokens.tolist()) for g in plan.groups]
    assert groups == [(0, 0, slice(0, 2), [0, 1]), (1, 1, slice(0, 1), [1]), (2, 1, slice(1, 3), [0, 1])]


def test_static_ep_moves_each_token_less_than_half_as_often_as_one_copy_per_expert():
    """k=8 of 16 experts on 2 hosts in static EP's contiguous blocks: the bytes of the routed calls
    against one float32 row per (token, expert) each way (the packed call before it)."""
    rng = np.random.default_rng(0)
    tokens, hidden = 256, 576
    idx = torch.tensor(np.stack([rng.choice(16, 8, replace=False) for _ in range(tokens)]))
    placement = LayerPlacement.even(np.arange(16), np.arange(16) // 8, 16)
    plan = plan_scatter(0, idx, torch.rand(tokens, 8), placement)
    routed = sum(b.call.request_bytes(hidden, torch.float32) + b.call.reply_bytes(hidden, torch.float32)
                 for b in plan.hosts.values())
    per_pair = 2 * idx.numel() * hidden * 4
    assert routed <= 0.5 * per_pair, routed / per_pair


def test_tokens_of_one_expert_split_by_share_over_hosts():
    idx = torch.zeros((20, 1), dtype=torch.long)  # all 20 tokens to expert 0
    placement = LayerPlacement(np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([0.3, 0.7, 1.0]))
    plan = plan_scatter(0, idx, torch.ones(20, 1), placement)
    assert plan.hosts[0].call.tokens.tolist() == list(range(6))
    assert plan.hosts[1].call.tokens.tolist() == list(range(6, 20))
    assert plan.hosts[0].experts == [0] and plan.hosts[1].counts == [14]


def test_chunks_under_min_rows_join_the_largest_chunk():
    idx = torch.zeros((10, 1), dtype=torch.long)  # 0.3 / 0.7 of 10 tokens would be 3 + 7
    placement = LayerPlacement(np.array([0, 0, 1]), np.array([0, 1, 1]), np.array([0.3, 0.7, 1.0]))
    plan = plan_scatter(0, idx, torch.ones(10, 1), placement)
    assert 0 not in plan.hosts and plan.hosts[1].call.tokens.tolist() == list(range(10))


@settings(max_examples=100, deadline=None)
@given(st.lists(st.tuples(st.integers(0, 3), st.integers(0, 12)), min_size=1, max_size=10))
def test_merge_small_chunks_keeps_sums_and_leaves_no_small_split(pairs):
    expert = np.array([e for e, _ in pairs])
    counts = np.array([c for _, c in pairs])
    merged = merge_small_chunks(expert, counts, MIN_CHUNK)
    for e in np.unique(expert):
        mine = merged[expert == e]
        assert mine.sum() == counts[expert == e].sum()
        live = mine[mine > 0]
        assert live.size <= 1 or (live >= MIN_CHUNK).all()


def test_gate_choice_outside_placement_is_an_error():
    placement = LayerPlacement.even(np.array([0, 1]), np.array([0, 0]), 2)
    with pytest.raises(ValueError, match="only 2 experts"):
        plan_scatter(0, torch.tensor([[3]]), torch.ones(1, 1), placement)


def test_evacuate_moves_dead_hosts_replicas_to_least_loaded_live_hosts():
    placement = LayerPlacement.even(np.array([0, 1, 2, 3, 0]), np.array([0, 0, 1, 2, 2]), 4)
    moved = evacuate(placement, {0}, 3)
    assert 0 not in moved.gpu.tolist()
    assert moved.gpu.tolist() == [1, 1, 1, 2, 2]  # host 1 held 1, host 2 held 2; ties to the lower
    np.testing.assert_array_equal(moved.share, placement.share)
    with pytest.raises(NoLiveHostError, match="all 3 expert hosts are down"):
        evacuate(placement, {0, 1, 2}, 3)


def test_evacuate_merges_two_replicas_of_an_expert_on_one_host():
    """Per-call re-levelling (the live loop) assumes one replica per (expert, host): shares of
    duplicates were lost there (30% of an expert's tokens unrouted); merged, every token is routed."""
    from moeless.placement.latency_model import LatencyModel
    from moeless.placement.dispatch import pair_tokens

    placement = LayerPlacement(np.array([0, 1, 2, 3, 0, 1]), np.array([0, 0, 1, 1, 2, 2]),
                               np.array([0.5, 0.7, 1, 1, 0.5, 0.3]))
    moved = evacuate(placement, {2}, 3)
    pairs = list(zip(moved.expert.tolist(), moved.gpu.tolist()))
    assert len(pairs) == len(set(pairs)) and (2, 1) in pairs
    np.testing.assert_allclose(np.bincount(moved.expert, weights=moved.share), np.ones(4))
    load = np.array([20, 10, 5, 5])
    levelled = pair_tokens(load, moved, LatencyModel(alpha=1e-5, beta=0.0, cold_start=0.0, call_overhead=1e-6), 3)
    assert levelled.gpu_tokens(load, 3).sum() == load.sum()


def test_long_prefix_runs_add_up_as_the_reference_on_a_prefill_sized_layer():
    """k=8 of 16 experts, 2 hosts in contiguous blocks, 300 tokens: host 0 adds up to 8 pairs into
    one row for most tokens (thousands of pairs in one call): still the reference's sums, bit for bit."""
    rng = np.random.default_rng(1)
    idx = torch.tensor(np.stack([rng.choice(16, 8, replace=False) for _ in range(300)]))
    x, weight = torch.randn(300, 64) * 100, torch.rand(300, 8)  # enough elements for the CPU to go parallel
    placement = LayerPlacement.even(np.arange(16), np.arange(16) // 8, 16)
    plan = plan_scatter(0, idx, weight, placement)
    assert plan.hosts[0].call.pairs > 1000 and plan.hosts[0].call.n_out <= 300
    assert torch.equal(gather(plan, _host_outputs(plan, x), 64, x.dtype), _reference(x, idx, weight))


@pytest.mark.parametrize("threads", [1, 2])
def test_both_ways_of_adding_in_pair_order_equal_a_row_by_row_loop(threads):
    """add_in_pair_order's one op (a CPU host's) and its op per expert (a GPU host's, run here on the
    CPU) add shared rows exactly as one row at a time, in pair order, does."""
    from moeless.expert_fn.host.run_routed import add_in_pair_order

    rng, before = np.random.default_rng(2), torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        for _ in range(20):
            n_out = int(rng.integers(1, 30))
            counts = rng.integers(1, n_out + 1, int(rng.integers(1, 9))).tolist()
            # An expert has a row's token once: each expert's rows are distinct.
            out = torch.from_numpy(np.concatenate([rng.choice(n_out, c, replace=False) for c in counts]))
            ys = torch.randn(sum(counts), 257) * torch.from_numpy(rng.uniform(1e-3, 1e3, (sum(counts), 1))).float()
            want = torch.zeros(n_out, 257)
            for j in range(len(out)):
                want[out[j]] += ys[j]
            for one_op in (True, False):
                got = torch.zeros(n_out, 257)
                add_in_pair_order(got, out, ys, counts, one_op=one_op)
                assert torch.equal(got, want), (one_op, threads)
    finally:
        torch.set_num_threads(before)


def test_a_host_writes_single_rows_once_and_adds_shared_rows_from_zeros():
    """run_routed's three ways into z, on a z full of stale values (a reused buffer): pairs in their
    own rows in pair order, a permutation of rows (each written once), and rows that pairs share or
    that no pair writes (added from zeros: the unwritten row is 0, never the stale value)."""
    x, weight = torch.randn(3, 5), torch.rand(3)
    y = lambda e, rows: _fake_expert(e, x[rows])
    calls = {  # out -> what z must be
        (0, 1, 2): [y(0, [0]) * weight[0], y(0, [1]) * weight[1], y(1, [2]) * weight[2]],
        (2, 0, 1): [y(0, [1]) * weight[1], y(1, [2]) * weight[2], y(0, [0]) * weight[0]],
        (0, 1, 0): [torch.zeros(1, 5) + y(0, [0]) * weight[0] + y(1, [2]) * weight[2], y(0, [1]) * weight[1],
                    torch.zeros(1, 5)],
    }
    for out, want in calls.items():
        call = RoutedCall(0, [0, 1], [2, 1], torch.arange(3), torch.arange(3, dtype=torch.int32),
                          torch.tensor(out, dtype=torch.int32), weight, 3)
        decoded = decode_call(encode_call(1, call, x))
        z = torch.full((3, 5), float("nan"))
        assert torch.equal(run_routed(_FakeRuntime(), decoded, z)[0], torch.cat(want))
    assert decoded.singles is False and decode_call(encode_call(1, RoutedCall(
        0, [0, 1], [2, 1], torch.arange(3), torch.arange(3, dtype=torch.int32), torch.tensor([2, 0, 1], dtype=torch.int32),
        weight, 3), x)).singles is True
