"""Two models on the same expert-host processes (expert_fn/stores/model_stores.py): each model's forward
through the shared hosts equals that model alone, in-process; their replicas share the hosts'
memory; a client bound to one model sees only its own replicas."""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch

from moeless.controller.operator.meters import parse_host_metrics
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.errors import ExpertHostError
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.tiny import tiny_model
from moeless.model.weight_store import export_experts
from moeless.placement.types import Placement
from moeless.serving.executor import RemoteExecutor
from moeless.serving.placement_source import PlacementSource

MODELS = {"tiny-mixtral": ("mixtral", 0), "tiny-qwen2": ("qwen2_moe", 1)}  # two geometries, one activation


@pytest.fixture(scope="module")
def two_models(tmp_path_factory):
    models, stores = {}, []
    for name, (arch, seed) in MODELS.items():
        model = tiny_model(arch, seed)
        root = tmp_path_factory.mktemp(name)
        export_experts(model.iter_experts(), root, model=name, num_layers=model.spec.num_layers,
                       num_experts=model.spec.num_experts, act=model.spec.act)
        models[name] = model
        stores.append((name, root))
    with launch_local_hosts(2, stores, keep_alive_s=60, metrics=False) as group:
        yield models, group


def _batch(seed: int, vocab: int = 128):
    g = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, vocab, (3, 10), generator=g)
    return ids, torch.ones_like(ids)


@pytest.mark.parametrize("transport", ["local", "tcp", "nixl", "grpc"])
def test_each_model_on_shared_hosts_equals_itself_alone(two_models, transport):
    models, group = two_models
    for i, (name, model) in enumerate(models.items()):
        clients = [ExpertHostClient(a, timeout_s=30, transport=transport, model=name) for a in group.addresses]
        spec = model.spec
        executor = RemoteExecutor(clients, PlacementSource(Placement.static(spec.num_layers, spec.num_experts, 2)))
        try:
            ids, mask = _batch(i)
            reference = model.forward(ids, mask).logits
            got = model.forward(ids, mask, executor=executor).logits
            assert torch.equal(got, reference), name
        finally:
            for c in clients:
                c.close()


def test_the_models_share_each_host_and_each_client_sees_its_own_replicas(two_models):
    models, group = two_models
    with ExpertHostClient(group.addresses[0]) as host:
        offered = {m["name"]: m for m in host.models()}
        assert list(offered) == list(MODELS)  # in --store order, one layer space
        first, second = offered.values()
        assert (first["first_layer"], second["first_layer"]) == (0, first["layers"])
        assert first["experts"] == models["tiny-mixtral"].spec.num_experts
        assert second["experts"] == models["tiny-qwen2"].spec.num_experts
        everything = host.status()["replicas"]
    per_model = {}
    for name in MODELS:
        with ExpertHostClient(group.addresses[0], model=name) as client:
            client.load(1, 0, wait=True)
            per_model[name] = client.status()["replicas"]
            assert all(0 <= r["layer"] < offered[name]["layers"] for r in per_model[name])
            assert any(r["layer"] == 1 and r["expert"] == 0 for r in per_model[name])
    with ExpertHostClient(group.addresses[0]) as host:
        everything = host.status()["replicas"]
    assert len(everything) == sum(len(v) for v in per_model.values())  # one memory, every model's replicas
    assert {(r["layer"], r["expert"]) for r in everything} >= {(1, 0), (offered["tiny-qwen2"]["first_layer"] + 1, 0)}


def test_a_model_the_host_does_not_serve_is_a_clear_error(two_models):
    _, group = two_models
    with ExpertHostClient(group.addresses[0], model="llama") as client:
        with pytest.raises(ExpertHostError, match=r"does not serve model 'llama'; it serves \['tiny-mixtral', 'tiny-qwen2'\]"):
            client.load(0, 0)


def test_one_model_s_loads_evict_the_other_s_idle_replicas_from_the_shared_memory(two_models, tmp_path):
    """One memory for both models: with room for two replicas, loading the second model's experts
    evicts the first model's least recently used ones (the host's LRU spans models)."""
    models, _ = two_models
    stores = [(name, tmp_path / name) for name in MODELS]
    for (name, root), model in zip(stores, models.values()):
        export_experts(model.iter_experts(), root, model=name, num_layers=model.spec.num_layers,
                       num_experts=model.spec.num_experts, act=model.spec.act)
    biggest = max(4 * model.spec.hidden_size * model.spec.expert_ffn * 3 for model in models.values())
    with launch_local_hosts(1, stores, keep_alive_s=600, metrics=False, memory_bytes=2 * biggest) as group:
        a = ExpertHostClient(group.addresses[0], model="tiny-mixtral")
        b = ExpertHostClient(group.addresses[0], model="tiny-qwen2")
        try:
            a.load(0, 0, wait=True)
            a.load(0, 1, wait=True)
            b.load(0, 0, wait=True)
            resident = lambda client: {(r["layer"], r["expert"]) for r in client.status()["replicas"]
                                       if r["state"] in ("idle", "warm")}
            assert resident(b) == {(0, 0)} and resident(a) == {(0, 1)}  # a's (0, 0) was used least recently
        finally:
            a.close()
            b.close()


def test_one_app_serves_both_models_by_name_each_exactly(two_models, ray_serve, reference_text):
    """The HTTP API over two ModelServer deployments on the same hosts: each request goes to the model
    it names and equals that model's own greedy completion."""
    import functools

    import httpx
    from ray import serve

    from moeless.serving.app import build_app
    from moeless.serving.config import ServeConfig

    models, group = two_models
    for address in group.addresses:  # the hosts start this test empty: earlier tests loaded replicas
        for name, model in models.items():
            with ExpertHostClient(address, model=name) as client:
                for r in client.status()["replicas"]:
                    client.evict(r["layer"], r["expert"])
    configs = [ServeConfig(name, functools.partial(tiny_model, *MODELS[name]), tuple(group.addresses), replica_cpus=0.2,
                           ingress_cpus=0.1, host_model=name) for name in MODELS]
    serve.run(build_app(configs), name="moeless", route_prefix="/")
    listed = httpx.get(ray_serve + "/v1/models", timeout=30).json()["data"]
    assert [m["id"] for m in listed] == list(MODELS)
    for name, model in models.items():
        r = httpx.post(ray_serve + "/v1/completions", json={"model": name, "prompt": "The cat sat", "max_tokens": 6},
                       timeout=60)
        assert r.status_code == 200, r.text
        assert r.json()["model"] == name and r.json()["choices"][0]["text"] == reference_text(model, "The cat sat", 6)
    unknown = httpx.post(ray_serve + "/v1/completions", json={"model": "llama", "prompt": "x", "max_tokens": 1}, timeout=30)
    assert unknown.status_code == 404 and "tiny-mixtral" in unknown.text
    health = httpx.get(ray_serve + "/healthz", timeout=30)
    assert health.status_code == 200 and set(health.json()["models"]) == set(MODELS)
    # Each model's first request loaded its experts from the store: one wake each, metered under its
    # name; a second request right after finds them warm and is no wake.
    name = next(iter(models))
    r = httpx.post(ray_serve + "/v1/completions", json={"model": name, "prompt": "The cat sat", "max_tokens": 2},
                   timeout=60)
    assert r.status_code == 200
    metrics = httpx.get(ray_serve + "/metrics", timeout=30).text
    for model in MODELS:
        assert f'moeless_model_wake_seconds_count{{model="{model}"}} 1.0' in metrics, metrics
        loads = re.search(rf'moeless_model_wake_cold_starts_total{{model="{model}"}} (\S+)', metrics)
        assert loads and float(loads.group(1)) > 0


def test_a_quiet_model_gives_its_memory_back_while_the_other_serves_and_its_next_request_wakes_it(two_models, tmp_path):
    """Expert grain: with a keep-alive of 1 s, the quiet model's replicas leave the shared hosts while
    the busy one keeps its own; the quiet model's next forward loads its experts again (cold starts)
    and still equals the model alone."""
    import time

    models, _ = two_models
    stores = [(name, tmp_path / name) for name in MODELS]
    for (name, root), model in zip(stores, models.values()):
        export_experts(model.iter_experts(), root, model=name, num_layers=model.spec.num_layers,
                       num_experts=model.spec.num_experts, act=model.spec.act)
    busy_name, quiet_name = MODELS
    with launch_local_hosts(2, stores, keep_alive_s=1.0, metrics=False) as group:
        executors, clients = {}, []
        for name, model in models.items():
            bound = [ExpertHostClient(a, timeout_s=30, model=name) for a in group.addresses]
            clients += bound
            spec = model.spec
            executors[name] = RemoteExecutor(bound, PlacementSource(Placement.static(spec.num_layers, spec.num_experts, 2)))

        def forward(name, seed):
            ids, mask = _batch(seed)
            model = models[name]
            assert torch.equal(model.forward(ids, mask, executor=executors[name]).logits, model.forward(ids, mask).logits)

        def resident(name):
            return sum(r["state"] in ("idle", "warm") for c in clients if c.model == name for r in c.status()["replicas"])

        try:
            forward(quiet_name, 0)
            woken_before = executors[quiet_name].times.cold_starts
            assert resident(quiet_name) > 0
            deadline = time.monotonic() + 3.0
            while time.monotonic() < deadline:  # the busy model keeps serving past the quiet one's keep-alive
                forward(busy_name, 1)
            assert resident(quiet_name) == 0 and resident(busy_name) > 0
            forward(quiet_name, 2)  # its next request wakes it
            assert executors[quiet_name].times.cold_starts > woken_before and resident(quiet_name) > 0
        finally:
            for c in clients:
                c.close()


def test_a_shared_host_meters_each_model_and_the_models_add_up_to_the_host(two_models, tmp_path):
    """/metrics of a host serving two models: each model's GB·s, tokens and replicas under its own name
    and its own layer numbers (what the operator bills each policy on a shared pool from)."""
    models, _ = two_models
    stores = [(name, tmp_path / name) for name in MODELS]
    for (name, root), model in zip(stores, models.values()):
        export_experts(model.iter_experts(), root, model=name, num_layers=model.spec.num_layers,
                       num_experts=model.spec.num_experts, act=model.spec.act)
    with launch_local_hosts(1, stores, keep_alive_s=600) as group:
        hidden = {name: m.spec.hidden_size for name, m in models.items()}
        with ExpertHostClient(group.addresses[0], model="tiny-mixtral") as a, \
                ExpertHostClient(group.addresses[0], model="tiny-qwen2") as b:
            a.invoke(1, {0: torch.randn(5, hidden["tiny-mixtral"])})
            b.invoke(1, {2: torch.randn(3, hidden["tiny-qwen2"]), 3: torch.randn(4, hidden["tiny-qwen2"])})
            # A client bound to a model reads its model's part of the meters (what its planning loop reports).
            assert (a.status()["meters"]["tokens"], b.status()["meters"]["tokens"]) == (5, 7)
            assert (a.status()["meters"]["cold_starts"], b.status()["meters"]["cold_starts"]) == (1, 2)
            for client in (a, b):  # it pays for its own replicas only (one clock reading per Status)
                st = client.status()
                assert st["meters"]["gb_s"] == pytest.approx(sum(r["gb_s"] for r in st["replicas"]), rel=1e-9)
            with ExpertHostClient(group.addresses[0]) as host:
                assert host.status()["meters"]["tokens"] == 12 and host.status()["meters"]["cold_starts"] == 3
        reading = parse_host_metrics(urllib.request.urlopen(f"{group.metrics_urls[0]}/metrics", timeout=10).read().decode())
    assert {name: m.tokens for name, m in reading.models.items()} == {"tiny-mixtral": 5, "tiny-qwen2": 7}
    assert {(r.model, r.layer, r.expert) for r in reading.replicas if r.bytes_held > 0} == {
        ("tiny-mixtral", 1, 0), ("tiny-qwen2", 1, 2), ("tiny-qwen2", 1, 3)}  # each model's own layer 1
    assert all(m.gb_seconds > 0 for m in reading.models.values())
    assert sum(m.bytes_held for m in reading.models.values()) == reading.bytes_held
    assert sum(m.gb_seconds for m in reading.models.values()) == pytest.approx(reading.gb_seconds, rel=1e-9)
