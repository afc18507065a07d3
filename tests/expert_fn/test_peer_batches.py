"""A LoadMany's copies from one peer batched (expert_fn/host/peer_batches.py): pure bookkeeping, golden."""

from __future__ import annotations

from concurrent.futures import Future

import torch

from moeless.expert_fn.host.peer_batches import Batch, CopyBatches, copy_bound
from moeless.expert_fn.host.peer_holder import chunked

KEY = "bfloat16-48x576-{}"  # a content key's shape: dtype-FxH-sha256
A, B, C, D = (KEY.format(c * 64) for c in "abcd")
PEER, OTHER = "10.0.0.7:50051", "10.0.0.8:50051"


def test_copy_bound_is_the_key_s_shape_at_float32_or_wider():
    assert copy_bound(A) == 3 * 48 * 576 * 4  # bfloat16 travels as the holder's float32 at most
    assert copy_bound(f"float64-2x3-{'e' * 64}") == 3 * 2 * 3 * 8


def test_the_first_copy_takes_what_is_pending_from_its_peer_and_the_others_wait_for_it():
    batches = CopyBatches()
    batches.expect(PEER, [A, B, C])
    batches.expect(OTHER, [D])
    batch = batches.take(PEER, B, capacity=3 * copy_bound(A))  # B's worker first: B, then A and C in order
    assert isinstance(batch, Batch) and batch.keys == [B, A, C] and set(batch.futures) == {A, C}
    assert batches.pending(PEER) == 0 and batches.pending(OTHER) == 1  # another peer's stay
    waiting = batches.take(PEER, C, capacity=3 * copy_bound(A))
    assert isinstance(waiting, Future) and not waiting.done()
    weights = {"gate": torch.zeros(1)}
    batch.settle({C: weights})  # A not brought (the holder did not hold it): None, its worker copies it alone
    assert waiting.result() is weights and batches.take(PEER, A, capacity=copy_bound(A)).result() is None
    assert batches.take(PEER, A, capacity=copy_bound(A)).keys == [A]  # taken once: later, a copy of its own


def test_a_batch_stops_at_the_region_s_capacity_and_discarded_or_old_keys_are_not_taken():
    batches = CopyBatches()
    batches.expect(PEER, [A, B, C, D])
    batches.discard(PEER, B)  # read from the store instead
    assert batches.take(PEER, A, capacity=2 * copy_bound(A)).keys == [A, C]  # room for one more
    assert batches.take(PEER, D, capacity=copy_bound(D)).keys == [D]
    old = CopyBatches(max_age_s=0.0)
    old.expect(PEER, [A, B])
    assert old.take(PEER, A, capacity=10 * copy_bound(A)).keys == [A]  # B expected too long ago: dropped


def test_a_holder_chunks_an_ask_s_replicas_in_order_as_many_whole_ones_as_fit_its_region():
    assert chunked([3, 0, 4, 2, 5], 6) == [[0], [2, 3], [4]]  # the replica not held (0 bytes) in none
    assert chunked([2, 2, 2], 6) == [[0, 1, 2]]  # one WRITE where the region holds them all
    assert chunked([0, 0], 6) == [] and chunked([2, 7], 6) == []  # nothing to write; one past the region: bytes
