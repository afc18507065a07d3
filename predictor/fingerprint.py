"""A model's fingerprint: predictors and traces are only valid for the model they came from."""

from __future__ import annotations

import hashlib

import torch

SAMPLE = 4096  # elements hashed from the start of every parameter: cheap, and any retrained model differs


def model_hash(model) -> str:
    """16 hex digits identifying a MoEModel: its spec, every gate in full, a sample of every parameter."""
    h = hashlib.sha256(repr(model.spec).encode())
    with torch.no_grad():
        for l in range(model.spec.num_layers):
            h.update(model.gate(l).weight.detach().float().contiguous().numpy().tobytes())
        for name, param in model.hf.state_dict().items():
            h.update(name.encode())
            h.update(str(tuple(param.shape)).encode())
            h.update(param.detach().reshape(-1)[:SAMPLE].float().contiguous().numpy().tobytes())
    return h.hexdigest()[:16]
