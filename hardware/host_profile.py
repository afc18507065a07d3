"""The cost profile of a running deployment, measured on one of its own expert hosts: the one
fitter of a host's per-call cost (the planning loop's calibration, `moeless bench live` and `bench
serve`'s latency model use it).

Packed calls of m experts x n tokens each (m in CALL_EXPERTS, n in CALL_TOKENS by default) to a
real host: the host's compute (its own clock: the compute thread's CPU time on a CPU) and the rest
of the round trip (wall - compute: the transfer and the call's handling). `fit_costs` fits, over
the medians of `repeats` calls per shape (the typical call, not the luckiest; `fit_host_calls`
makes the calls and fits them):

    compute  = host_s + call_overhead x m + alpha x T      (T = m x n tokens)
    transfer = c0 + 2 beta x T

and one replica's load is timed from disk (a first load: read, sha256, copy) and from the host
memory tier (a reload after eviction); the re-level of one layer's shares is timed in this
process (the serving replica's data plane). `profile` is the CostProfile planners price with; host_s +
c0 (a host call's fixed cost, which the per-replica planners do not model) is kept beside it for
predicting a call's critical path.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Sequence

import numpy as np

from moeless.expert_fn.wire.routed import RoutedCall
from moeless.placement.latency_model import LatencyModel
from moeless.placement.profile import CostProfile
from moeless.placement.timing import (measure_relevel_check_s, measure_relevel_per_replica_s, measure_relevel_s,
                                      measure_relevel_skip_s)

CALL_EXPERTS = (1, 2, 4, 8)
CALL_TOKENS = (1, 4, 16, 64)


@dataclass(frozen=True)
class HostCosts:
    """A calibration: the planners' profile and a host call's fixed cost (host_s + c0, seconds)."""

    profile: CostProfile
    host_call_s: float
    samples: dict

    def as_dict(self) -> dict:
        return {"profile": self.profile.__dict__, "host_call_s": self.host_call_s, "samples": self.samples}


def fit_costs(shapes: Sequence[tuple[int, int]], compute_s: Sequence[float], transfer_s: Sequence[float]) -> dict:
    """Least squares over calls of (m experts, T tokens): compute = host_s + call_overhead m + alpha T,
    transfer = c0 + 2 beta T; negative estimates (noise) are clipped to 0."""
    m = np.array([s[0] for s in shapes], dtype=np.float64)
    t = np.array([s[1] for s in shapes], dtype=np.float64)
    host_s, call, alpha = np.linalg.lstsq(np.stack([np.ones_like(m), m, t], axis=1), np.asarray(compute_s), rcond=None)[0]
    slope, c0 = np.polyfit(t, np.asarray(transfer_s), 1)
    return {"host_s": max(float(host_s), 0.0), "call_overhead": max(float(call), 0.0), "alpha": max(float(alpha), 0.0),
            "c0": max(float(c0), 0.0), "beta": max(float(slope), 0.0) / 2}


def fit_host_calls(client, hidden: int, experts: Sequence[int] = CALL_EXPERTS, tokens: Sequence[int] = CALL_TOKENS,
                   repeats: int = 10, layer: int = 0) -> dict:
    """Time packed calls of m experts x n tokens (m in `experts`, n in `tokens`; `repeats` calls per
    shape, their median) on `client`'s host, which loads and keeps experts 0..max(experts)-1 of
    `layer`, and fit them (fit_costs): its host_s, call_overhead, alpha, c0 and beta with the
    samples (shapes (m, T), compute_s, transfer_s)."""
    import torch

    names = list(range(max(experts)))
    for e in names:
        client.load(layer, e, wait=True)
    shapes, compute, transfer = [], [], []
    for m in experts:
        for n in tokens:
            x, rows = torch.randn(m * n, hidden), torch.arange(m * n)
            samples = []
            for _ in range(repeats):
                started = time.perf_counter()
                result = client.submit(RoutedCall.packed(layer, names[:m], [n] * m, rows), x).result()
                samples.append((result.compute_s, time.perf_counter() - started - result.compute_s))
            median = np.median(np.array(samples), axis=0)  # robust to a busy machine's outliers
            shapes.append((m, m * n))
            compute.append(float(median[0]))
            transfer.append(float(median[1]))
    return {"shapes": shapes, "compute_s": compute, "transfer_s": transfer, **fit_costs(shapes, compute, transfer)}


def calibrate_host(client, hidden: int, non_expert_bytes: int, num_experts: int, num_hosts: int, repeats: int = 10,
                   layer: int = 0) -> HostCosts:
    """Measure `client`'s host (see the module docstring) on calls of up to num_experts (a layer's)
    experts, and this process's re-level of a layer over num_hosts hosts; the host keeps the
    replicas of `layer` it loads."""
    sizes = [m for m in CALL_EXPERTS if m <= num_experts] or [num_experts]
    fit = fit_host_calls(client, hidden, sizes, CALL_TOKENS, repeats, layer)
    loads = _load_seconds(client, layer, max(sizes) - 1)
    replica = next(r for r in client.status()["replicas"] if (r["layer"], r["expert"]) == (layer, 0))
    model = LatencyModel(alpha=fit["alpha"], beta=fit["beta"], cold_start=loads["host"], call_overhead=fit["call_overhead"])
    profile = CostProfile(alpha=fit["alpha"], beta=fit["beta"], call_overhead=fit["call_overhead"], load_s=loads,
                          expert_bytes=int(replica["bytes"]), non_expert_bytes=int(non_expert_bytes),
                          relevel_s=measure_relevel_s(num_experts, num_hosts, model, repeats),
                          relevel_check_s=measure_relevel_check_s(num_experts, num_hosts, model, repeats),
                          relevel_per_replica_s=measure_relevel_per_replica_s(num_experts, num_hosts, model, repeats),
                          relevel_skip_s=measure_relevel_skip_s(num_experts, num_hosts, model, repeats),
                          source=f"expert host {client.address}: one copy of each token per expert, medians of {repeats}, compute on the host's "
                                 "clock")
    return HostCosts(profile, fit["host_s"] + fit["c0"], fit)


def _load_seconds(client, layer: int, expert: int) -> dict[str, float]:
    """One replica's load from disk (its first, or after the host tier dropped it) and from host memory."""
    def timed() -> float:
        client.load(layer, expert, wait=True)
        return next(r["last_load_s"] for r in client.status()["replicas"] if (r["layer"], r["expert"]) == (layer, expert))

    disk = timed()
    while not client.evict(layer, expert):  # a call may still hold it
        time.sleep(0.01)
    return {"disk": disk, "host": timed()}


SPLIT_PROBE_ROWS = ((8, 4), (24, 12), (64, 28), (200, 96))  # (rows, the first part's rows): parts of >= MIN_CHUNK


def split_exact(client, hidden: int, layer: int = 0, expert: int = 0, seed: int = 0) -> bool:
    """Whether `client`'s host computes a part of an expert's rows bit for bit as it computes them
    all at once (then a split expert's output equals the unmodified model's: serving/scatter.py).
    BLAS picks its kernel by the row count, and some round differently (48-neuron experts on this
    CPU: most row counts). Packed calls of expert `expert` of `layer` on random rows, whole and in
    two parts, at each of SPLIT_PROBE_ROWS; False at the first difference."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    client.load(layer, expert, wait=True)

    def run(x: torch.Tensor) -> torch.Tensor:
        rows = x.shape[0]
        return client.submit(RoutedCall.packed(layer, [expert], [rows], torch.arange(rows)), x).result().z.cpu()

    for rows, first in SPLIT_PROBE_ROWS:
        x = torch.randn(rows, hidden, generator=generator)
        whole = run(x)
        if not (torch.equal(run(x[:first]), whole[:first]) and torch.equal(run(x[first:]), whole[first:])):
            return False
    return True
