"""What an expert host answers to a routed call, computed in-process: fake hosts' compute for the
executor's unit tests (the frame is encoded and decoded as on a real transport)."""

from types import SimpleNamespace

import torch

from moeless.expert_fn.wire.routed import RoutedResult, decode_call, encode_call
from moeless.expert_fn.host.run_routed import run_routed
from moeless.model.experts import expert_forward


def answer(model, call, x) -> RoutedResult:
    """The routed call's answer with `model`'s own experts."""
    def invoke(layer, batches, on_device=False, out=None):
        outputs = {e: expert_forward(model.expert_weights(layer, e), xs, model.spec.act) for e, xs in batches.items()}
        if out is not None:  # the outputs as out's consecutive slices, as ExpertHostRuntime.invoke
            torch.cat(list(outputs.values()), out=out)
        return SimpleNamespace(outputs=outputs, cold_starts=0, compute_s=0.0)

    runtime = SimpleNamespace(invoke=invoke, device="cpu", dtype=torch.float32)
    z, cold, compute = run_routed(runtime, decode_call(encode_call(0, call, x)))
    return RoutedResult(z, cold, compute)
