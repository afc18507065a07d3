"""The cost profile measured on this machine's CPU (`moeless bench planner`, `moeless eval`).

At the expert shape of the model whose loads are replayed (placement/profile.py):
alpha and the call overhead from a least-squares fit of `expert_forward` time over 1..256
tokens; beta from copying a decode-sized [T, H] float32 batch through a preallocated send buffer; one replica's load from disk
(read, sha256, parse, copy: the expert host's path with its host tier off) and from the host
memory tier (the copy alone); expert and non-expert bytes; the serving replica's re-level of one
layer's shares on its actual loads and the check whether it pays (placement/timing.py). Each time
is the fastest of its repeats. The same on a GPU: hardware/cuda_profile.py.
"""

from __future__ import annotations

import tempfile
from typing import Sequence

import numpy as np
import torch

from moeless.expert_fn.stores.tiers import DeviceCopier, HostTier, TierConfig
from moeless.model.experts import expert_forward
from moeless.model.weight_store import export_experts
from moeless.placement.latency_model import LatencyModel
from moeless.placement.profile import CostProfile
from moeless.placement.timing import (fastest_seconds, measure_relevel_check_s, measure_relevel_per_replica_s,
                                      measure_relevel_s, measure_relevel_skip_s)


def fit_line(sizes: Sequence[int], seconds: Sequence[float]) -> tuple[float, float]:
    """Least-squares seconds = intercept + slope * size: (slope, intercept), both clipped at 0."""
    slope, intercept = np.polyfit(np.asarray(sizes, dtype=np.float64), np.asarray(seconds), 1)
    return max(float(slope), 0.0), max(float(intercept), 0.0)


def measure_profile(hidden: int, ffn: int, non_expert_bytes: int, repeats: int = 50, threads: int = 1,
                    source: str = "", *, num_experts: int, num_gpus: int) -> tuple[CostProfile, dict]:
    """Measure the cost profile on this machine for experts of shape H=hidden, F=ffn (float32),
    torch on `threads` threads, layers of num_experts experts over num_gpus GPUs (the re-level).
    Returns (profile, the raw timings)."""
    saved_threads = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        gen = torch.Generator().manual_seed(0)
        weights = {
            "gate": torch.randn(ffn, hidden, generator=gen) * 0.02,
            "up": torch.randn(ffn, hidden, generator=gen) * 0.02,
            "down": torch.randn(hidden, ffn, generator=gen) * 0.02,
        }
        # 1. alpha and the call overhead: one expert FFN call on T tokens.
        token_counts = [1, 4, 16, 64, 256]
        with torch.no_grad():
            ffn_s = [fastest_seconds(lambda x=torch.randn(t, hidden): expert_forward(weights, x), repeats) for t in token_counts]
        alpha, call = fit_line(token_counts, ffn_s)

        # 2. beta: copy a [T, H] float32 batch into a send buffer and out of it into a tensor (one
        #    direction), both preallocated as the data plane's channels hold them (expert_fn/wire/routed.py).
        #    Decode-sized batches, whose three buffers stay in cache on any CPU with 1 MB of L2: with 256
        #    tokens (1.8 MB) and a fresh buffer per call the slope measured page faults and the memory level
        #    the batch spilled to (0.26-0.29x the roofline's beta on a 2 MB L2), not the per-token copy.
        moved = [16, 32, 64]
        wire, landed = torch.empty(max(moved) * hidden), torch.empty(max(moved), hidden)

        def move(x: torch.Tensor) -> torch.Tensor:
            n = x.numel()
            wire[:n].copy_(x.reshape(-1))
            return landed[:x.shape[0]].copy_(wire[:n].view(x.shape))

        move_s = [fastest_seconds(lambda x=torch.randn(t, hidden): move(x), repeats) for t in moved]
        beta, _ = fit_line(moved, move_s)
        # 3. One replica's load, as the expert host runs it: from disk (tier off) and from host memory.
        copier = DeviceCopier("cpu")
        loads = max(5, repeats // 5)
        with tempfile.TemporaryDirectory() as root:
            store = export_experts([(0, 0, weights)], root, model="bench", num_layers=1, num_experts=1, act="silu")
            off, tier = HostTier(store, TierConfig(capacity_bytes=0)), HostTier(store)
            disk = fastest_seconds(lambda: copier.to_device(off.get((0, 0))[0]), loads)
            host = fastest_seconds(lambda: copier.to_device(tier.get((0, 0))[0]), loads)
            expert_bytes = store.expert_bytes(0, 0)
        # 4. The data plane's re-level of one layer's shares.
        relevel_model = LatencyModel(alpha=alpha, beta=beta, cold_start=host, call_overhead=call)
        relevel = measure_relevel_s(num_experts, num_gpus, relevel_model, repeats)
        check = measure_relevel_check_s(num_experts, num_gpus, relevel_model, repeats)
        per_replica = measure_relevel_per_replica_s(num_experts, num_gpus, relevel_model, repeats)
        skip = measure_relevel_skip_s(num_experts, num_gpus, relevel_model, repeats)
    finally:
        torch.set_num_threads(saved_threads)
    profile = CostProfile(alpha=alpha, beta=beta, call_overhead=call, load_s={"disk": disk, "host": host},
                          expert_bytes=expert_bytes, non_expert_bytes=non_expert_bytes, relevel_s=relevel,
                          relevel_check_s=check, relevel_per_replica_s=per_replica, relevel_skip_s=skip,
                          source=source or f"this machine's CPU, torch on {threads} thread(s), H={hidden} F={ffn} float32")
    facts = {"expert_shape": {"H": hidden, "F": ffn, "dtype": "float32"}, "torch_threads": threads,
             "ffn_tokens": token_counts, "ffn_seconds": ffn_s, "move_tokens": moved, "move_seconds": move_s}
    return profile, facts
