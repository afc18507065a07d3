"""A base and its fine-tunes on the same expert-host processes, their unchanged experts held once
(one replica per content key): each model's forward through the shared hosts equals the merged
model alone in-process, bit for bit, also while both models call at once; a host holding shared
replicas killed mid-call: both models fail over and stay exact."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.errors import ExpertHostError
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.finetune import perturbed
from moeless.model.moe_model import MoEModel
from moeless.model.tiny import tiny_model
from moeless.model.weight_store import export_experts
from moeless.placement.types import Placement
from moeless.serving.executor import RemoteExecutor
from moeless.serving.placement_source import PlacementSource

CHANGED = {"code": [(0, 1), (1, 3)], "chat": [(1, 0)]}



@pytest.fixture(scope="module")
def family(tmp_path_factory):
    """{name: model} and [(name, store)]: a tiny base and two fine-tunes, stores over the base's."""
    base = tiny_model("mixtral", 0)
    root = tmp_path_factory.mktemp("stores")
    spec = base.spec
    models = {"base": base, **{name: perturbed(base, experts, 0.05, seed) for seed, (name, experts) in enumerate(CHANGED.items(), 1)}}
    stores, base_store = [], None
    for name, model in models.items():
        store = export_experts(model.iter_experts(), root / name, model=name, num_layers=spec.num_layers,
                               num_experts=spec.num_experts, act=spec.act, base=base_store)
        base_store = base_store or store
        stores.append((name, store.root))
    return models, stores


def _executor(addresses, name: str, model: MoEModel) -> RemoteExecutor:
    clients = [ExpertHostClient(a, timeout_s=30, model=name) for a in addresses]
    spec = model.spec
    return RemoteExecutor(clients, PlacementSource(Placement.static(spec.num_layers, spec.num_experts, len(clients))))


def _close(executors: dict[str, RemoteExecutor]) -> None:
    for executor in executors.values():
        for client in executor.pool.clients().values():
            client.close()


def _batches(seed: int, count: int, vocab: int = 128):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, vocab, (2, 8), generator=g) for _ in range(count)]


def _forwards(models, executors, batches, during=None) -> dict[str, list[str]]:
    """Every model runs every batch through its executor, all models at once; `during(i)` runs on the
    first model's thread after its i-th forward. Returns each model's mismatches (empty: all exact)."""
    wrong: dict[str, list[str]] = {name: [] for name in models}

    def run(name: str) -> None:
        model = models[name]
        for i, ids in enumerate(batches):
            mask = torch.ones_like(ids)
            try:
                got = model.forward(ids, mask, executor=executors[name]).logits
                if not torch.equal(got, model.forward(ids, mask).logits):
                    wrong[name].append(f"batch {i}: logits differ")
            except Exception as err:  # recorded: the test names the model and the batch
                wrong[name].append(f"batch {i}: {type(err).__name__}: {err}")
            if during is not None and name == next(iter(models)):
                during(i)

    threads = [threading.Thread(target=run, args=(name,)) for name in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wrong


def test_each_fine_tune_through_the_shared_hosts_equals_its_merged_model_alone(family):
    models, stores = family
    with launch_local_hosts(2, stores, keep_alive_s=60, metrics=False) as group:
        executors = {name: _executor(group.addresses, name, model) for name, model in models.items()}
        assert _forwards(models, executors, _batches(0, 3)) == {name: [] for name in models}
        spec = models["base"].spec
        changed = sum(len(v) for v in CHANGED.values())
        held = 0
        for address in group.addresses:
            with ExpertHostClient(address) as host:
                held += sum(1 for r in host.status()["replicas"] if r["bytes"])
        # every expert routed, each distinct one held once: the base's plus the fine-tunes' own
        assert held == spec.num_layers * spec.num_experts + changed
        _close(executors)


def test_a_host_holding_shared_replicas_killed_mid_call_both_models_fail_over_exactly(family):
    models, stores = family
    with launch_local_hosts(2, stores, keep_alive_s=60, metrics=False) as group:
        executors = {name: _executor(group.addresses, name, model) for name, model in models.items()}
        with ExpertHostClient(group.addresses[1]) as host:
            assert _forwards(models, executors, _batches(1, 1)) == {name: [] for name in models}
            assert any(len(r["models"]) == 3 for r in host.status()["replicas"])  # shared replicas there

        def kill(i: int) -> None:
            if i == 1:
                time.sleep(0.01)  # the other models' forwards are in flight
                group.kill(1)

        assert _forwards(models, executors, _batches(2, 6), during=kill) == {name: [] for name in models}
        for name, executor in executors.items():
            assert executor.dead_hosts == {1}, name
        assert sum(e.times.retries for e in executors.values()) >= 1
        group.restart(1)
        _close(executors)


def test_a_fine_tune_added_to_running_hosts_serves_exactly_without_a_restart(family, tmp_path):
    """Hosts started with the base and one fine-tune gain a second fine-tune while serving (AddModel):
    same processes, nothing resident lost, the experts it shares with the base already warm (its first
    forward loads only its own), its answers exact; a store the hosts cannot serve is refused by name."""
    models, stores = family
    with launch_local_hosts(2, stores[:2], keep_alive_s=60, metrics=False) as group:
        pids = [group.pid(i) for i in range(2)]
        running = {name: models[name] for name, _ in stores[:2]}
        executors = {name: _executor(group.addresses, name, model) for name, model in running.items()}
        assert _forwards(running, executors, _batches(3, 2)) == {name: [] for name in running}
        for address in group.addresses:
            with ExpertHostClient(address) as host:
                since = time.monotonic()  # before the host reads its meters, so the bound holds
                before = host.status()
                served = host.add_model("chat", str(stores[2][1]))
                assert [m["name"] for m in served] == ["base", "code", "chat"]
                # the base's replicas of experts code replaced are shared from now on, not before
                after, held = host.status(), before["meters"]["bytes_held"] / 1e9
                grew = sum(after["models"][m]["shared_gb_s"] - before["models"][m]["shared_gb_s"] for m in ("base", "code"))
                assert grew <= (time.monotonic() - since) * held + 1e-12
                with pytest.raises(ExpertHostError, match="this host serves 'chat' already"):
                    host.add_model("chat", str(stores[2][1]))
                with pytest.raises(ExpertHostError, match=r"no weight-store index"):
                    host.add_model("nothing", str(tmp_path))
        executors["chat"] = _executor(group.addresses, "chat", models["chat"])
        def cold() -> int:
            total = 0
            for address in group.addresses:
                with ExpertHostClient(address) as host:
                    total += host.status()["meters"]["cold_starts"]
            return total

        before = cold()
        assert _forwards({"chat": models["chat"]}, executors, _batches(3, 2)) == {"chat": []}
        assert cold() - before <= len(CHANGED["chat"])  # only its own experts loaded: the shared were warm
        assert [group.pid(i) for i in range(2)] == pids
        assert _forwards(models, executors, _batches(4, 2)) == {name: [] for name in models}
        _close(executors)


def test_one_engine_batches_a_base_and_its_fine_tunes_each_answering_as_its_merged_model(family, reference_text):
    """serving/family.py: the base's non-expert layers run every request; each request's tokens go to its
    own model's experts; requests of all three models in one continuous batch, each text its merged model's."""
    from moeless.serving.api import GenerationRequest
    from moeless.serving.engine import Engine
    from moeless.serving.family import FamilyExecutor
    from moeless.serving.scheduler import Scheduler

    models, stores = family
    names = list(models)
    with launch_local_hosts(2, stores, keep_alive_s=60, metrics=False) as group:
        spec = models["base"].spec
        clients = [ExpertHostClient(a, timeout_s=30, model="base") for a in group.addresses]
        executor = FamilyExecutor(clients, PlacementSource(Placement.static(spec.num_layers, spec.num_experts, 2)), names)
        engine = Engine(tiny_model("mixtral", 0), executor, members=names)
        scheduler = Scheduler(engine)
        asks = [(names[i % 3], f"prompt {i}", 5 + i % 3) for i in range(7)]
        texts: dict[int, list[str]] = {}
        for i, (name, prompt, n) in enumerate(asks):
            texts[i] = []
            scheduler.submit(GenerationRequest(name, n, False, prompt=prompt),
                             lambda events, i=i: texts[i].extend(e.get("text", "") for e in events))
        for _ in range(40):
            scheduler.step()
        for i, (name, prompt, n) in enumerate(asks):
            assert "".join(texts[i]) == reference_text(models[name], prompt, n), (name, prompt)
        assert executor.times.layers > 0 and executor.dead_hosts == set()
        assert executor.family.blocks == 4  # the base's own ids, then blocks (j + 1) x E for j = 0 (base), 1, 2
        for address in group.addresses:  # one call per host carried every model's tokens, each metered as its own
            with ExpertHostClient(address) as host:
                parts = host.status()["models"]
            assert all(parts[name]["tokens"] > 0 for name in names), parts
        for client in clients:
            client.close()
