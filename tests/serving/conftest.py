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


@pytest.fixture(scope="session")
def ray_serve():
    """One local Ray + Serve per test session (ray.init costs ~5-10 s); yields the HTTP base URL."""
    import socket

    import ray
    from ray import serve

    ray.init(num_cpus=2, include_dashboard=False, log_to_driver=False)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    serve.start(http_options={"host": "127.0.0.1", "port": port})
    yield f"http://127.0.0.1:{port}"
    serve.shutdown()
    ray.shutdown()


@pytest.fixture(scope="session")
def deploy_tiny(ray_serve):
    """deploy_tiny(addresses, name, **ServeConfig options): the app for the tiny model at route "/"."""
    return _deploy_tiny


def _deploy_tiny(addresses, name: str, **options):
    """Deploy the serving app for tiny_model(TINY_ARCH, 0) over `addresses` at route "/"."""
    import functools

    from ray import serve

    from moeless.model.tiny import tiny_model
    from moeless.serving.app import build_app
    from moeless.serving.config import ServeConfig

    config = ServeConfig(name, functools.partial(tiny_model, TINY_ARCH, 0), tuple(addresses), replica_cpus=0.25,
                         ingress_cpus=0.1, **options)
    serve.run(build_app(config), name="moeless", route_prefix="/")
    return config


@pytest.fixture(scope="session")
def reference_text():
    """reference_text(model, prompt, max_tokens): the in-process reference's greedy completion."""
    return _reference_text


def _reference_text(model, prompt: str, max_tokens: int) -> str:
    """What greedy decoding of the in-process reference gives for `prompt` (character codec)."""
    import torch

    ids = torch.tensor([[ord(c) for c in prompt]])
    return "".join(chr(t) for t in model.generate(ids, max_tokens)[0, ids.shape[1]:].tolist())
