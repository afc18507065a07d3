"""This CPU's peaks, measured in about a second: what its kernels reach as a roofline device
(twin/roofline.cpu_roofline_profile predicts `moeless bench planner`'s measured profile from them;
docs/planner.md, "Profiles by roofline")."""

from __future__ import annotations

import hashlib
import os
import time
from dataclasses import dataclass
from typing import Callable

import numpy as np


@dataclass(frozen=True)
class CpuPeaks:
    """This CPU's measured peaks on `threads` torch threads (the bench's setting)."""

    flops: float  # float32 FLOP/s of a cache-resident matmul
    cache_bw: float  # bytes/s of a copy that fits the L2 cache (bytes copied, not read + written)
    dram_bw: float  # bytes/s of a 64 MiB copy (main memory)
    cache_bytes: int  # working sets up to this size move at cache_bw: half the L2
    op_s: float  # seconds of one torch op's dispatch on a tiny tensor
    hash_bw: float  # sha256 bytes/s
    threads: int

    def copy_bw(self, nbytes: int) -> float:
        """Copy bandwidth for a working set of nbytes: the memory level it lives in (the bench
        repeats each measurement on the same buffers, so small ones stay in cache)."""
        return self.cache_bw if nbytes <= self.cache_bytes else self.dram_bw


def _fastest(fn: Callable[[], object], repeats: int) -> float:
    fn()
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - start)
    return best


def _l2_bytes() -> int:
    try:
        size = os.sysconf("SC_LEVEL2_CACHE_SIZE")
    except (ValueError, OSError, AttributeError):
        size = 0
    return int(size) if size and size > 0 else 2 << 20


def measure_cpu_peaks(threads: int = 1, repeats: int = 30) -> CpuPeaks:
    """Measure this CPU in about a second: a 256^3 float32 matmul, a copy of a quarter of the L2
    and of 64 MiB, a tiny op's dispatch, sha256 of 1 MiB. Each the fastest of `repeats` (as bench
    planner takes its timings: on this shared 2-core machine a median swings 2-3x)."""
    import torch

    saved = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        a, c = torch.randn(256, 256), torch.randn(256, 256)
        flops = 2 * 256**3 / _fastest(lambda: a @ c, repeats)
        cache_bytes = _l2_bytes() // 2

        def copy_bw(nbytes: int, times: int) -> float:
            src = np.ones(nbytes // 4, dtype=np.float32)
            dst = np.empty_like(src)
            return src.nbytes / _fastest(lambda: np.copyto(dst, src), times)

        cache_bw, dram_bw = copy_bw(cache_bytes // 2, repeats), copy_bw(64 << 20, max(3, repeats // 5))
        tiny = torch.ones(4)
        op_s = _fastest(lambda: [tiny + tiny for _ in range(100)], repeats) / 100
        blob = bytes(1 << 20)
        hash_bw = len(blob) / _fastest(lambda: hashlib.sha256(blob).digest(), repeats)
    finally:
        torch.set_num_threads(saved)
    return CpuPeaks(flops, cache_bw, dram_bw, cache_bytes, op_s, hash_bw, threads)
