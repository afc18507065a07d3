"""Fixtures of the serving tests: a tiny model's weight store and real expert-host processes."""

from __future__ import annotations

import pytest

TINY_ARCH = "mixtral"  # 2 MoE layers x 4 experts, k = 2, no shared experts


@pytest.fixture(scope="session")
def tiny_store(tmp_path_factory):
    """(model, store_dir): tiny_model(TINY_ARCH, 0) and its exported weight store."""
    from moeless.model.tiny import tiny_model
    from moeless.model.weight_store import export_experts

    model = tiny_model(TINY_ARCH, 0)
    root = tmp_path_factory.mktemp("tiny-store")
    spec = model.spec
    export_experts(model.iter_experts(), root, model=f"tiny-{TINY_ARCH}", num_layers=spec.num_layers,
                   num_experts=spec.num_experts, act=spec.act)
    return model, root


@pytest.fixture(scope="module")
def hosts(tiny_store):
    """Three real expert-host processes serving the tiny store (closed after the module)."""
    from moeless.expert_fn.launcher import launch_local_hosts

    _, root = tiny_store
    with launch_local_hosts(3, root, keep_alive_s=60, metrics=False) as group:
        yield group
