"""A routed call run on a host's runtime: the rows gathered, the experts computed, the answer combined
in the reference's order (the frame itself is wire/routed.py)."""

from __future__ import annotations

import numpy as np
import torch

from moeless.expert_fn.wire.routed import Decoded


def run_routed(runtime, call: Decoded, z: torch.Tensor | None = None):
    """Run a routed call on an ExpertHostRuntime -> (z [n_out, H], cold_starts, compute_s); z is
    written into `z` when given (a transport's preallocated buffer)."""
    head = call.head
    # 1. Every pair's row gathered from x in one copy (expert-major), one view per expert, one
    #    runtime call for all of them, its outputs written into one [P, H] tensor in pair order.
    #    (A decode step's call is tiny: every torch op skipped counts.) A GPU host does all of it
    #    on the GPU: x goes over once, z comes back once.
    device = runtime.device
    on_cpu = device == "cpu"
    x = call.x.to(device)  # no copy where it is already (a CPU host's frame, a caller's GPU buffer)
    src, out, weight = (call.src, None, call.weight) if on_cpu else lists_on(call, device)
    rows = x.index_select(0, src)
    batches = {call.experts[0]: rows} if len(call.experts) == 1 else dict(zip(call.experts, torch.split(rows, call.counts)))
    ys = torch.empty(head.pairs, head.hidden, dtype=runtime.dtype, device=device)
    result = runtime.invoke(head.layer, batches, on_device=True, out=ys)
    # 2. Weighted in one multiply, then into z. Each pair its own row: written (0 + s is s), in
    #    place where the rows are in pair order. Otherwise each row's pairs are added up from zeros
    #    in pair order, which is ascending expert order within a row (pairs are expert-major), as
    #    the reference (model/moe_model.LocalExecutor) adds each expert (add_in_pair_order).
    ys = ys if ys.dtype == head.dtype else ys.to(head.dtype)
    weight = weight[:, None]
    target = z if z is not None and z.device == ys.device else None  # z in host memory for a GPU host: copied at the end
    if call.pair_order:
        target = ys.mul_(weight) if target is None else torch.mul(ys, weight, out=target)
    else:
        target = torch.empty(head.n_out, head.hidden, dtype=head.dtype, device=device) if target is None else target
        out = torch.from_numpy(call.out.astype(np.int64)) if on_cpu else out.long()
        if call.singles:
            target.index_copy_(0, out, ys.mul_(weight))
        else:
            add_in_pair_order(target.zero_(), out, ys.mul_(weight), call.counts, one_op=on_cpu)
    if z is not None and target is not z:
        target = z.copy_(target)
    elif not on_cpu:
        target = target.cpu()
    return target, result.cold_starts, result.compute_s


def lists_on(call: Decoded, device: str) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(src [P] int32, out [P] int32, weight [P] in the call's dtype) on `device`, in one copy: the
    frame holds them side by side (each pageable host-to-GPU copy costs its own 15-30 us)."""
    head, pairs = call.head, call.head.pairs  # >= 1: decode_body refuses a call without pairs
    lists = torch.frombuffer(call.body, dtype=torch.uint8, offset=8 * head.m, count=(8 + head.item) * pairs).to(device)
    return lists[:4 * pairs].view(torch.int32), lists[4 * pairs:8 * pairs].view(torch.int32), lists[8 * pairs:].view(head.dtype)


def add_in_pair_order(target: torch.Tensor, out: torch.Tensor, ys: torch.Tensor, counts: list[int], one_op: bool) -> None:
    """target[out[j]] += ys[j] for every pair j, in pair order. target: [n_out, H]; out: [P] long;
    ys: [P, H]; counts: pairs per expert (expert-major, an expert has a row's token once).

    one_op (a CPU): one index_add_, which on a CPU adds its source rows in index order (measured
    exact against a row-by-row loop at 1 and 2 threads; index_put_ with accumulate was not at 2
    threads, and took ~2x as long). Otherwise (a GPU, whose atomics add in no fixed order) one
    index_add_ per expert, ascending: no element is added twice in one op, so the same sums."""
    if one_op:
        target.index_add_(0, out, ys)
        return
    for rows, part in zip(torch.split(out, counts), torch.split(ys, counts)):
        target.index_add_(0, rows, part)
