"""`moeless bench planner --device cuda`: the cost profile measured on a GPU, for a model geometry.

The same fields as the CPU profile (hardware/cpu_profile.py), measured with CUDA events on the
geometry's expert in its dtype (bf16 for the published models):
1. alpha and the call overhead: least squares over 1..4096 tokens of one `expert_forward` call.
   Each call uses the next of enough expert copies to overflow the GPU's L2 twice, so every call
   reads its weights from memory as a replica's first call of a layer does.
2. beta: a [T, H] copy from GPU 0 to GPU 1 (slope over T) when there are two GPUs; with one GPU,
   no link to measure: the roofline's beta, said in `facts` and the source.
3. One replica's load from the host memory tier (pinned host -> device, on a copy stream) and from
   disk (the weight store's read + sha256 + parse, pin, copy), synchronised before the clock stops.
4. Bytes from the geometry; the serving replica's re-level measured on this CPU (it runs there).
Each time is the fastest of its repeats, as on the CPU. Without CUDA: one clear error.
The expert host (expert_fn/stores/tiers.py) today converts weights to float32 on the device; this bench
measures the geometry's own dtype, as a bf16 deployment (and the roofline) would run it.
"""

from __future__ import annotations

import tempfile
import time
from typing import Callable

from moeless.hardware.cpu_profile import fit_line
from moeless.model.experts import expert_forward
from moeless.model.weight_store import export_experts
from moeless.placement.latency_model import LatencyModel
from moeless.placement.profile import CostProfile
from moeless.placement.timing import (measure_relevel_check_s, measure_relevel_per_replica_s, measure_relevel_s,
                                      measure_relevel_skip_s)

TOKENS = (1, 16, 64, 256, 1024, 4096)
MOVED = (256, 1024, 4096)


class CudaUnavailable(RuntimeError):
    """--device cuda where torch has no usable CUDA device."""


def require_cuda():
    """torch, with a usable CUDA device, or CudaUnavailable saying why."""
    import torch

    if not torch.cuda.is_available():
        built = torch.version.cuda
        why = f"this torch ({torch.__version__}) is built without CUDA" if built is None else \
            f"torch {torch.__version__} (CUDA {built}) sees no GPU (driver missing or CUDA_VISIBLE_DEVICES empty)"
        raise CudaUnavailable(f"--device cuda: {why}; run it on a machine with an NVIDIA GPU and a CUDA build of torch, "
                              "or leave --device at cpu")
    return torch


def _event_seconds(torch, fn: Callable[[int], object], repeats: int) -> float:
    """Fastest of `repeats` runs of fn(i) on the current stream, timed with CUDA events (after a
    warm-up; each run synchronised, so no run overlaps the next)."""
    fn(0)
    torch.cuda.synchronize()
    best = float("inf")
    for i in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn(i + 1)
        end.record()
        end.synchronize()
        best = min(best, start.elapsed_time(end) / 1e3)
    return best


def _sync_all(torch) -> None:
    """Wait for every visible GPU (a peer copy may run on either side's stream)."""
    for index in range(torch.cuda.device_count()):
        torch.cuda.synchronize(index)


def _wall_seconds(torch, fn: Callable[[], object], repeats: int) -> float:
    """Fastest wall time of fn() until every GPU is idle (host work and copies together)."""
    fn()
    _sync_all(torch)
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        _sync_all(torch)
        best = min(best, time.perf_counter() - start)
    return best


def measure_cuda_profile(geometry, repeats: int, *, num_experts: int, num_gpus: int,
                         roofline_beta: float) -> tuple[CostProfile, dict]:
    """The cost profile of `geometry`'s experts (a model geometry, twin/geometry.Geometry: its name,
    hidden, expert_ffn, dtype, expert_bytes and non_expert_bytes) measured on cuda:0 (steps 1-4 of
    the module docstring). roofline_beta (the replayed cluster's, by roofline) stands in for beta on a one-GPU
    machine. Returns (profile, facts)."""
    torch = require_cuda()
    dev = torch.device("cuda", 0)
    dtype = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32}.get(geometry.dtype, torch.bfloat16)
    h, f = geometry.hidden, geometry.expert_ffn
    gen = torch.Generator(device=dev).manual_seed(0)

    def expert() -> dict:
        return {"gate": torch.randn(f, h, generator=gen, device=dev, dtype=dtype) * 0.02,
                "up": torch.randn(f, h, generator=gen, device=dev, dtype=dtype) * 0.02,
                "down": torch.randn(h, f, generator=gen, device=dev, dtype=dtype) * 0.02}

    # 1. alpha and the call overhead, rotating over copies that overflow L2 twice.
    props = torch.cuda.get_device_properties(dev)
    l2 = int(getattr(props, "L2_cache_size", 0) or 64 << 20)
    copies = [expert() for _ in range(max(1, -(-2 * l2 // geometry.expert_bytes)))]
    num_copies = len(copies)
    ffn_s = []
    with torch.no_grad():
        for t in TOKENS:
            x = torch.randn(t, h, generator=gen, device=dev, dtype=dtype)
            ffn_s.append(_event_seconds(torch, lambda i, x=x: expert_forward(copies[i % len(copies)], x), repeats))
    alpha, call = fit_line(TOKENS, ffn_s)
    # 2. beta: GPU 0 -> GPU 1, when there is a GPU 1.
    move_s: list[float] = []
    if torch.cuda.device_count() > 1:
        peer = torch.device("cuda", 1)
        for t in MOVED:
            x = torch.randn(t, h, generator=gen, device=dev, dtype=dtype)
            move_s.append(_wall_seconds(torch, lambda x=x: x.to(peer, non_blocking=True), repeats))
        beta, _ = fit_line(MOVED, move_s)
    else:
        beta = roofline_beta
    # 3. Loads: pinned host -> device on a copy stream; disk = the store's load, pin, copy.
    host_weights = {n: w.cpu().pin_memory() for n, w in copies[0].items()}
    stream = torch.cuda.Stream(dev)

    def to_device(weights: dict) -> dict:
        with torch.cuda.stream(stream):
            out = {n: w.to(dev, non_blocking=True) for n, w in weights.items()}
        stream.synchronize()
        return out

    loads = max(3, repeats // 10)
    host = _wall_seconds(torch, lambda: to_device(host_weights), loads)
    with tempfile.TemporaryDirectory() as root:
        store = export_experts([(0, 0, {n: w.cpu() for n, w in copies[0].items()})], root, model="bench-cuda",
                               num_layers=1, num_experts=1, act="silu")
        disk = _wall_seconds(torch, lambda: to_device({n: w.pin_memory() for n, w in store.load(0, 0).items()}), loads)
    copies.clear()  # gives the GPU memory back before the CPU part
    torch.cuda.empty_cache()
    # 4. The serving replica's re-level (CPU work).
    relevel_model = LatencyModel(alpha=alpha, beta=beta, cold_start=host, call_overhead=call)
    relevel = measure_relevel_s(num_experts, num_gpus, relevel_model)
    check = measure_relevel_check_s(num_experts, num_gpus, relevel_model)
    per_replica = measure_relevel_per_replica_s(num_experts, num_gpus, relevel_model)
    skip = measure_relevel_skip_s(num_experts, num_gpus, relevel_model)
    name = torch.cuda.get_device_name(dev)
    beta_note = "GPU0->GPU1 copies" if move_s else "roofline (one GPU: no link to measure)"
    profile = CostProfile(alpha=alpha, beta=beta, call_overhead=call, load_s={"disk": disk, "host": host},
                          expert_bytes=geometry.expert_bytes, non_expert_bytes=geometry.non_expert_bytes, relevel_s=relevel,
                          relevel_check_s=check, relevel_per_replica_s=per_replica, relevel_skip_s=skip,
                          source=f"measured on {name}: {geometry.name} experts H={h} F={f} {geometry.dtype}; beta from {beta_note}")
    facts = {"device": name, "geometry": geometry.name, "dtype": geometry.dtype, "expert_copies": num_copies,
             "ffn_tokens": list(TOKENS), "ffn_seconds": ffn_s, "move_tokens": list(MOVED) if move_s else [],
             "move_seconds": move_s, "beta_measured": bool(move_s), "gpus_visible": torch.cuda.device_count()}
    return profile, facts
