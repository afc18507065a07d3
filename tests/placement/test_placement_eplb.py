"""EPLB against DeepSeek's published example, its invariants, and the EPLB triple round trip."""

from __future__ import annotations

import numpy as np
import pytest

from moeless.placement.eplb import balanced_packing, rebalance_experts, replicate_experts
from moeless.placement.types import Placement

# DeepSeek's published example: 2 layers, 12 experts, 16 replicas, 4 groups, 2 nodes, 8 GPUs.
WEIGHT = np.array(
    [[90, 132, 40, 61, 104, 165, 39, 4, 73, 56, 183, 86], [20, 107, 104, 64, 19, 197, 187, 157, 172, 86, 16, 27]]
)


def test_golden_example_from_deepseek():
    phy2log, log2phy, logcnt = rebalance_experts(WEIGHT, 16, 4, 2, 8)
    assert phy2log.tolist() == [
        [5, 6, 5, 7, 8, 4, 3, 4, 10, 9, 10, 2, 0, 1, 11, 1],
        [7, 10, 6, 8, 6, 11, 8, 9, 2, 4, 5, 1, 5, 0, 3, 1],
    ]
    assert logcnt.tolist() == [[1, 2, 1, 1, 2, 2, 1, 1, 1, 1, 2, 1], [1, 2, 1, 1, 1, 2, 2, 1, 2, 1, 1, 1]]
    # log2phy lists exactly the slots phy2log gives each expert.
    for l in range(2):
        for e in range(12):
            slots = sorted(s for s in log2phy[l, e] if s >= 0)
            assert slots == np.flatnonzero(phy2log[l] == e).tolist()


def test_global_variant_when_groups_do_not_divide_nodes():
    phy2log, _, logcnt = rebalance_experts(WEIGHT, 16, 3, 2, 8)  # 3 groups over 2 nodes: global
    assert phy2log.shape == (2, 16)
    assert (logcnt.sum(axis=1) == 16).all() and (logcnt >= 1).all()
    # Global replication gives the extra replicas to the heaviest load per replica.
    glob, _, glob_cnt = rebalance_experts(WEIGHT, 16, 1, 1, 8)
    assert np.array_equal(logcnt, glob_cnt) and np.array_equal(phy2log, glob)
    assert logcnt[0, 10] == 2 and logcnt[0, 7] == 1  # 183 tokens vs 4 tokens


def test_balanced_packing_gives_every_pack_the_same_count_heaviest_first():
    weight = np.array([[10.0, 1.0, 9.0, 2.0, 8.0, 3.0]])
    pack, rank = balanced_packing(weight, 3)
    assert np.bincount(pack[0], minlength=3).tolist() == [2, 2, 2]
    assert pack[0].tolist() == [0, 0, 1, 1, 2, 2]  # 10, 9, 8 open packs; 3, 2, 1 fill the lightest
    assert sorted(zip(pack[0], rank[0])) == sorted({(p, r) for p, r in zip(pack[0], rank[0])})


def test_replicate_experts_splits_the_heaviest_per_replica_load():
    phy2log, rank, logcnt = replicate_experts(np.array([[100.0, 10.0, 40.0]]), 6)
    # Per-replica maxima in turn: 100 (expert 0), 50 (expert 0), 40 (expert 2).
    assert logcnt.tolist() == [[3, 1, 2]]
    assert phy2log[0].tolist() == [0, 1, 2, 0, 0, 2] and rank[0, 3:].tolist() == [1, 2, 1]


def test_triple_round_trips_through_placement():
    phy2log, log2phy, logcnt = rebalance_experts(WEIGHT, 16, 4, 2, 8)
    placement = Placement.from_eplb(phy2log, 12, 8)
    back_phy2log, back_log2phy, back_logcnt = placement.to_eplb()
    assert np.array_equal(back_phy2log, phy2log) and np.array_equal(back_logcnt, logcnt)
    for l in range(2):
        assert placement.layers[l].gpu.tolist() == [p // 2 for p in range(16)]


@pytest.mark.parametrize(
    "args, message",
    [
        ((WEIGHT, 15, 4, 2, 8), "multiple of the GPU count"),
        ((WEIGHT, 8, 4, 2, 8), ">= E"),
        ((WEIGHT, 16, 5, 1, 8), "groups"),
        ((WEIGHT, 16, 4, 3, 8), "nodes"),
        ((-WEIGHT, 16, 4, 2, 8), "non-negative"),
        ((WEIGHT[0], 16, 4, 2, 8), r"\[L, E\]"),
    ],
)
def test_invalid_inputs_raise_clear_errors(args, message):
    with pytest.raises(ValueError, match=message):
        rebalance_experts(*args)
