"""Expert compute and the wire format: grouped == sequential == expert_forward; tensors round-trip."""

from __future__ import annotations

import pytest
import torch

from moeless.expert_fn.wire import expert_host_pb2 as pb
from moeless.expert_fn.wire.codec import batches_from_proto, put_batches, tensor_from_proto
from moeless.expert_fn.errors import BadRequest
from moeless.expert_fn.host.executor import forward_for, grouped_forward, sequential_forward
from moeless.model.experts import expert_forward


def experts(n: int, hidden: int = 12, ffn: int = 20) -> list[dict[str, torch.Tensor]]:
    gen = torch.Generator().manual_seed(n)
    return [
        {"gate": torch.randn(ffn, hidden, generator=gen), "up": torch.randn(ffn, hidden, generator=gen),
         "down": torch.randn(hidden, ffn, generator=gen)}
        for _ in range(n)
    ]


@pytest.mark.parametrize("forward", [sequential_forward, grouped_forward])
@pytest.mark.parametrize("act", ["silu", "gelu"])
def test_forwards_match_the_canonical_expert_on_uneven_batches(forward, act):
    weights = experts(3)
    xs = [torch.randn(n, 12) for n in (5, 0, 9)]
    outs = forward(weights, xs, act)
    assert [o.shape for o in outs] == [(5, 12), (0, 12), (9, 12)]
    for w, x, out in zip(weights, xs, outs):
        torch.testing.assert_close(out, expert_forward(w, x, act), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("forward", [sequential_forward, grouped_forward])
def test_forwards_write_into_out_as_consecutive_slices(forward):
    """With out, each output is out's next slice (no tensor of its own) and has the same bits."""
    weights, xs = experts(3), [torch.randn(n, 12) for n in (5, 0, 9)]
    out = torch.full((14, 12), float("nan"))
    outs = forward(weights, xs, "silu", out)
    assert [o.shape[0] for o in outs] == [5, 0, 9]
    assert (outs[0].data_ptr(), outs[2].data_ptr()) == (out[0].data_ptr(), out[5].data_ptr())
    for got, want in zip(outs, forward(weights, xs, "silu")):
        assert torch.equal(got, want)


def test_grouped_forward_of_nothing_is_nothing():
    assert grouped_forward([], [], "silu") == []


def test_a_gpu_groups_small_experts_only_and_a_cpu_never(monkeypatch):
    import moeless.expert_fn.host.executor as executor

    assert forward_for("cuda:0") is executor.gpu_forward and forward_for("cpu") is sequential_forward
    assert forward_for("cuda:0", exact=True) is sequential_forward  # float32: the reference model's kernels
    chosen = []
    monkeypatch.setattr(executor, "grouped_forward", lambda w, x, a, out=None: chosen.append("grouped") or [])
    monkeypatch.setattr(executor, "sequential_forward", lambda w, x, a, out=None: chosen.append("sequential") or [])
    small = {n: torch.empty(64, 64) for n in ("gate", "up", "down")}  # 48 KB
    large = {n: torch.empty(executor.GROUPED_MAX_BYTES // 8, 1) for n in ("gate", "up", "down")}  # 1.5x the bound
    for weights in ([small, small], [large, large], []):
        executor.gpu_forward(weights, [], "silu")
    assert chosen == ["grouped", "sequential", "grouped"]


def test_batches_round_trip_exactly_as_raw_float32():
    batches = {3: torch.randn(7, 5, dtype=torch.float64), 0: torch.empty(0, 5)}
    request = pb.InvokeRequest(layer=1)
    put_batches(request.batches, batches)
    assert [b.expert for b in request.batches] == [3, 0]
    assert list(request.batches[0].x.shape) == [7, 5] and len(request.batches[0].x.data) == 7 * 5 * 4
    decoded = batches_from_proto(pb.InvokeRequest.FromString(request.SerializeToString()).batches)
    torch.testing.assert_close(decoded[3], batches[3].float(), rtol=0, atol=0)
    assert decoded[0].shape == (0, 5) and decoded[0].dtype == torch.float32


def test_tensor_with_wrong_byte_count_is_refused():
    with pytest.raises(BadRequest, match="needs 24 bytes"):
        tensor_from_proto(pb.Tensor(shape=[2, 3], data=b"\0" * 20))


def test_an_expert_twice_in_one_call_is_refused():
    request = pb.InvokeRequest(layer=0)
    put_batches(request.batches, {1: torch.zeros(1, 2)})
    put_batches(request.batches, {1: torch.zeros(1, 2)})
    with pytest.raises(BadRequest, match="appears twice"):
        batches_from_proto(request.batches)
