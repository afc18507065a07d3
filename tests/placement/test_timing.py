"""The data plane's pairing timed on this machine (placement/timing.py): each replica of a layer past
its homes and G copies adds to a pairing, so full replication costs more a call (measured here: about
2x at E = 64 on 8 GPUs), and one GPU has nothing to replicate."""

from __future__ import annotations

from moeless.placement.latency_model import LatencyModel
from moeless.placement.timing import (measure_relevel_check_s, measure_relevel_per_replica_s, measure_relevel_s,
                                      measure_relevel_skip_s)

MODEL = LatencyModel(alpha=2e-7, beta=1e-9, cold_start=1e-3, call_overhead=2e-5)


def test_each_replica_more_adds_to_a_pairing_and_one_gpu_has_none():
    per_replica = measure_relevel_per_replica_s(64, 8, MODEL, repeats=30)
    base = measure_relevel_s(64, 8, MODEL, repeats=30)
    # 440 replicas more than the 72 relevel_s is timed on: a slope above zero and below relevel_s a replica
    assert 0 < per_replica < base
    assert measure_relevel_per_replica_s(64, 1, MODEL) == 0.0


def test_a_call_whose_check_the_gate_skips_costs_less_than_the_check():
    # the skip routes a cached split; the check runs the compiled check and the gate's records
    assert 0 < measure_relevel_skip_s(64, 8, MODEL, repeats=200) < measure_relevel_check_s(64, 8, MODEL, repeats=200)
