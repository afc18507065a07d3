"""Runs the token batches of several experts of one layer: the compute of one Invoke call.

Two ways, same results: one expert after another (`sequential_forward`), or all of them as one
grouped computation (`grouped_forward`: weights stacked, tokens padded to the largest batch, three
batched matmuls). A CPU runs them one after another, and so does a host computing in float32, which promises the
reference model's bits. A GPU otherwise (`gpu_forward`) groups small experts,
where kernel launches dominate, and runs large ones one after another: stacking copies every
weight on every call: on an H200 at Mixtral-8x7B's expert (352 MB in bfloat16) the grouped
forward took 2.0-2.6x the sequential one in bfloat16, 1.2-2.9x in float32 (docs/benchmarks.md).
"""

from __future__ import annotations

import time
from typing import Callable

import torch

from moeless.model.experts import activation, expert_forward

Weights = dict[str, torch.Tensor]  # {"gate": [F, H], "up": [F, H], "down": [H, F]}


def sequential_forward(weights: list[Weights], xs: list[torch.Tensor], act: str,
                       out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """[expert_forward(w, x)] for each pair. weights[i] as above; xs[i]: [n_i, H] -> [n_i, H];
    with out ([sum n_i, H]) the outputs are its consecutive slices, written in place."""
    if out is None:
        return [expert_forward(w, x, act) for w, x in zip(weights, xs)]
    slices = torch.split(out, [x.shape[0] for x in xs])
    return [expert_forward(w, x, act, out=o) for w, x, o in zip(weights, xs, slices)]


def grouped_forward(weights: list[Weights], xs: list[torch.Tensor], act: str,
                    out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """Same as sequential_forward, as one padded batched computation over the R experts.

    Steps: 1. stack weights to [R, F, H] / [R, H, F]; 2. pad tokens to X: [R, n_max, H];
    3. down(act(X gate^T) * X up^T) with bmm; 4. cut each expert's rows back out (into `out`'s
    consecutive slices when given, as sequential_forward).
    """
    if not xs:
        return []
    sizes = [x.shape[0] for x in xs]
    gate = torch.stack([w["gate"] for w in weights])
    up = torch.stack([w["up"] for w in weights])
    down = torch.stack([w["down"] for w in weights])
    padded = xs[0].new_zeros(len(xs), max(sizes), xs[0].shape[1])
    for i, x in enumerate(xs):
        padded[i, : sizes[i]] = x
    hidden = activation(act)(torch.bmm(padded, gate.transpose(1, 2))) * torch.bmm(padded, up.transpose(1, 2))
    grouped = torch.bmm(hidden, down.transpose(1, 2))
    cut = [grouped[i, :n] for i, n in enumerate(sizes)]
    return cut if out is None else list(torch.split(torch.cat(cut, out=out), sizes))


GROUPED_MAX_BYTES = 16 * 2**20  # one expert's weights up to which a GPU groups: stacking them costs ~us


def gpu_forward(weights: list[Weights], xs: list[torch.Tensor], act: str,
                out: torch.Tensor | None = None) -> list[torch.Tensor]:
    """grouped_forward for experts of at most GROUPED_MAX_BYTES each, else sequential_forward."""
    size = sum(t.numel() * t.element_size() for t in weights[0].values()) if weights else 0
    return (grouped_forward if size <= GROUPED_MAX_BYTES else sequential_forward)(weights, xs, act, out)


def forward_for(device: str, exact: bool = False):
    """The forward used on `device`: gpu_forward on CUDA, sequential elsewhere. exact: sequential
    everywhere, the reference model's own kernels: a batched matmul rounds differently from the
    model's per-expert matmul on a GPU (16 of 20 float32 layer calls differed on an H200)."""
    return gpu_forward if device.startswith("cuda") and not exact else sequential_forward


def compute_clock(device: str) -> Callable[[], float]:
    """The clock an invoke's compute is timed on (runtime.py's docstring): the calling thread's CPU
    time when it alone computes (a CPU device, one torch thread), else wall time."""
    return time.thread_time if device == "cpu" and torch.get_num_threads() == 1 else time.perf_counter
