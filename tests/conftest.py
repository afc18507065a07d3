"""Fixtures shared by every component's tests (keep this small)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session", autouse=True)
def _few_torch_threads():
    """CI runs on 2 cores shared by the whole suite: keep torch's intra-op pool small."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(2)


@pytest.fixture
def tiny():
    """A factory of tiny random MoE models: tiny("mixtral", seed=0) -> MoEModel (fresh each call)."""
    from moeless.model.tiny import tiny_model

    return tiny_model
