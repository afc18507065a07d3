"""Cluster inventory, the latency model's two execution models, the Oracle's loads, diffs."""

from __future__ import annotations

import numpy as np
import pytest

from moeless.placement.cluster import Cluster, ClusterError
from moeless.placement.diff import diff, diff_layer
from moeless.placement.latency_model import LatencyModel
from moeless.placement.oracle import oracle_load
from moeless.placement.types import LayerPlacement, Placement

MODEL = LatencyModel(alpha=1.0, beta=0.1, cold_start=5.0, call_overhead=2.0)


def test_paper_execution_runs_replicas_in_parallel_serial_runs_them_one_after_another():
    # Experts 0 and 1 share GPU 0; expert 2 has two replicas on GPUs 1 and 0.
    layer = LayerPlacement.even(np.array([0, 1, 2, 2]), np.array([0, 0, 1, 0]), 3)
    load = np.array([10, 6, 8])
    # paper: max replica 10 tokens; GPU 0 receives 10 + 6 + 4 = 20 tokens.
    assert MODEL.layer_time(load, layer, 2, "paper") == pytest.approx(10 + 2 * 0.1 * 20)
    # serial: GPU 0 runs 10 + 6 + 4 tokens and 3 calls.
    assert MODEL.layer_time(load, layer, 2, "serial") == pytest.approx(20 + 3 * 2.0 + 2 * 0.1 * 20)
    # An expert without tokens costs no call.
    assert MODEL.layer_time(np.array([10, 0, 0]), layer, 2, "serial") == pytest.approx(10 + 2.0 + 2 * 0.1 * 10)
    with pytest.raises(ValueError, match="execution model"):
        MODEL.layer_time(load, layer, 2, "parallel")
    with pytest.raises(ValueError, match="alpha"):
        LatencyModel(alpha=-1.0, beta=0.0, cold_start=0.0)


def test_oracle_spreads_the_same_whole_tokens_over_experts():
    spread = oracle_load(np.array([[10, 0, 0, 1], [0, 0, 0, 0]]))
    assert spread.tolist() == [[3, 3, 3, 2], [0, 0, 0, 0]]
    with pytest.raises(ValueError, match="non-negative"):
        oracle_load(np.array([-1, 2]))


def test_cluster_slots_caps_and_clear_errors():
    cluster = Cluster(np.array([250.0, 100.0]), expert_bytes=100, layer_memory_cap=300)
    assert cluster.slots().tolist() == [2, 1] and cluster.layer_replica_cap() == 3 and cluster.num_gpus == 2
    cluster.check_fits(1, 3)
    with pytest.raises(ClusterError, match="need 6"):
        cluster.check_fits(2, 3)
    with pytest.raises(ClusterError, match="fewer than the 4 experts"):
        Cluster.uniform(2, 8, 100, layer_cap_replicas=3).check_fits(1, 4)
    with pytest.raises(ClusterError, match="at least one GPU"):
        Cluster(np.array([]), expert_bytes=100)
    with pytest.raises(ClusterError, match="at least one GPU"):
        Cluster.uniform(0, 4, 100)
    with pytest.raises(ClusterError, match="larger than every GPU"):
        Cluster(np.array([50.0, 99.0]), expert_bytes=100)


def test_diff_counts_cold_loads_evictions_and_kept_replicas():
    before = LayerPlacement.even(np.array([0, 1, 1]), np.array([0, 0, 1]), 2)
    after = LayerPlacement.even(np.array([0, 1]), np.array([1, 0]), 2)
    d = diff_layer(before, after)
    assert d.cold_loads.tolist() == [[0, 1]] and d.evictions.tolist() == [[0, 0], [1, 1]] and d.kept == 1
    assert d.churn == 3 and d.cold_loads_per_gpu(2).tolist() == [0, 1]
    fresh = diff(None, Placement((after,), 2, 2))
    assert fresh[0].churn == 2 and fresh[0].kept == 0
    with pytest.raises(ValueError, match="layers"):
        diff(Placement((after, after), 2, 2), Placement((after,), 2, 2))
