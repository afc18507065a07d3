"""The fakes the local channel's tests share: a runtime with simple experts and a routed call."""

from __future__ import annotations

from types import SimpleNamespace

import torch

from moeless.expert_fn.errors import BadRequest
from moeless.expert_fn.wire.routed import RoutedCall, decode_call, encode_call
from moeless.expert_fn.host.run_routed import run_routed

H = 8


class FakeRuntime:
    """invoke like ExpertHostRuntime's: tokens computed in float32, outputs float32; expert e
    maps x to x * (e + 1) + 0.25. Layer 9 does not exist."""

    device, dtype = "cpu", torch.float32

    def __init__(self):
        self.health = "serving"
        self.calls = 0

    def invoke(self, layer, batches, on_device=False, out=None):
        if layer == 9:
            raise BadRequest(f"no expert (layer {layer}, expert 0)")
        self.calls += 1
        outputs = {e: x.to(torch.float32) * (e + 1) + 0.25 for e, x in batches.items()}
        if out is not None:  # the outputs as out's consecutive slices, as ExpertHostRuntime.invoke
            torch.cat(list(outputs.values()), out=out)
        return SimpleNamespace(outputs=outputs, cold_starts=len(batches), compute_s=0.001)


def _routed(dtype: torch.dtype) -> RoutedCall:
    """Tokens 1, 3, 4, 7 of x; experts 0, 2, 3 with several pairs per token, each token's pairs
    summed into its own output row, random weights."""
    gen = torch.Generator().manual_seed(1)
    src = torch.tensor([0, 1, 2, 0, 3, 1, 2], dtype=torch.int32)  # expert 0: 3 pairs, 2: 2, 3: 2
    return RoutedCall(0, [0, 2, 3], [3, 2, 2], torch.tensor([1, 3, 4, 7]), src, src.clone(),
                      torch.rand(7, generator=gen).to(dtype), 4)


def _reference(call: RoutedCall, x: torch.Tensor) -> torch.Tensor:
    """What the host computes: routed.run_routed on the decoded frame (any transport)."""
    return run_routed(FakeRuntime(), decode_call(encode_call(1, call, x)))[0]
