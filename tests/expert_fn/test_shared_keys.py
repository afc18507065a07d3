"""One replica per content key on a host serving a base and its fine-tunes (model_stores.py, runtime.py):
real host processes; each model's calls exact; the shared replica held once, used by both models'
calls at once, evicted only when neither needs it, protected by either model's share; the
per-model GB·s adding up to the host's."""

from __future__ import annotations

import threading
import time
import urllib.request

import pytest
import torch

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.host.runtime import ExpertHostRuntime
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.expert_fn.stores.model_stores import ModelStores
from moeless.model.experts import expert_forward
from moeless.model.finetune import perturbed
from moeless.model.moe_model import MoEModel
from moeless.model.tiny import tiny_model
from moeless.model.weight_store import export_store

CHANGED = {"code": [(0, 1), (1, 3)], "chat": [(0, 1), (1, 0)]}  # both change (0, 1), each its own way



@pytest.fixture(scope="module")
def family(tmp_path_factory, monkeypatch_module):
    """{name: (model, store)}: a tiny base and two fine-tunes over it, stores in one cache."""
    monkeypatch_module.setenv("MOELESS_CACHE", str(tmp_path_factory.mktemp("cache")))
    base = tiny_model("mixtral", 0)
    out = {"base": (base, export_store(base, "base"))}
    for seed, (name, experts) in enumerate(CHANGED.items(), 1):
        model = perturbed(base, experts, 0.01, seed)
        out[name] = (model, export_store(model, name, base=out["base"][1]))
    return out


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _bytes(model: MoEModel) -> int:
    return 3 * model.spec.expert_ffn * model.spec.hidden_size * 4


def test_the_host_s_layer_space_maps_equal_keys_to_one_replica(family):
    stores = ModelStores.open([(name, root) for name, (_, root) in family.items()])
    spec = family["base"][0].spec
    layers = spec.num_layers
    assert stores.canonical(layers + 0, 0) == (0, 0) and stores.canonical(2 * layers + 1, 2) == (1, 2)
    assert stores.canonical(layers + 0, 1) == (layers + 0, 1)  # code's own (0, 1)
    assert stores.users((0, 0)) == (0, 1, 2) and stores.users((0, 1)) == (0,) and stores.users((layers, 1)) == (1,)
    changed = sum(len(v) for v in CHANGED.values())
    assert len(list(stores.keys())) == layers * spec.num_experts + changed  # each distinct expert once
    assert set(stores.aliases()[(0, 0)]) == {(layers, 0), (2 * layers, 0)}
    # family addressing: expert (j + 1) x E + e of a layer is model j's expert e of that layer
    experts = spec.num_experts
    assert stores.resolve(1, 2 * experts + 3) == (layers + 1, 3) and stores.resolve(layers + 1, experts + 2) == (1, 2)
    assert stores.has(1, 4 * experts - 1) and not stores.has(1, 4 * experts) and not stores.has(1, -1)


def test_two_models_calls_at_once_share_one_replica_each_exact_and_their_gb_s_add_up(family):
    roots = [(name, root) for name, (_, root) in family.items()]
    with launch_local_hosts(1, roots, keep_alive_s=60, metrics=True) as group:
        clients = {name: ExpertHostClient(group.addresses[0], model=name) for name in family}
        errors, barrier = [], threading.Barrier(len(clients))

        def calls(name: str) -> None:
            model = family[name][0]
            # The reference at the host's one thread (conftest's; OpenMP's count is per thread and a new
            # thread starts at the machine's): on AVX2 MKL rounds 5-7 rows on 2 threads otherwise.
            torch.set_num_threads(1)
            try:
                barrier.wait()
                for i in range(20):
                    x = torch.randn(4 + i % 3, model.spec.hidden_size)
                    out = clients[name].invoke(1, {0: x, 3: x})
                    for e in (0, 3):
                        assert torch.equal(out[e], expert_forward(model.expert_weights(1, e), x, model.spec.act)), (name, e)
            except Exception as err:  # reported below, with the model's name
                errors.append((name, err))

        threads = [threading.Thread(target=calls, args=(name,)) for name in clients]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        assert errors == []
        host = clients["base"].status()
        with ExpertHostClient(group.addresses[0]) as whole:
            everything = whole.status()
        held = {(r["layer"], r["expert"]): r for r in everything["replicas"] if r["bytes"]}
        layers = family["base"][0].spec.num_layers
        # (1, 0) is base's and code's (chat changed it); (1, 3) base's and chat's (code changed it)
        assert set(held) == {(1, 0), (1, 3), (2 * layers + 1, 0), (layers + 1, 3)}
        assert held[(1, 0)]["models"] == ["base", "code"] and held[(1, 0)]["loads"] == 1
        assert held[(1, 0)]["tokens"] == 2 * sum(4 + i % 3 for i in range(20))
        parts, host_meters = everything["models"], everything["meters"]  # one reading
        assert sum(p["gb_s"] for p in parts.values()) == pytest.approx(host_meters["gb_s"], rel=1e-9)
        assert sum(p["bytes_held"] for p in parts.values()) == host_meters["bytes_held"] == 4 * _bytes(family["base"][0])
        assert sum(p["tokens"] for p in parts.values()) == host_meters["tokens"]
        assert (parts["base"]["shared_replicas"], parts["base"]["own_replicas"]) == (2, 0)
        assert (parts["code"]["shared_replicas"], parts["code"]["own_replicas"]) == (1, 1)
        assert host_meters["shared_replicas"] == 2
        assert clients["code"].status()["meters"]["shared_bytes"] == _bytes(family["base"][0])
        text = urllib.request.urlopen(f"{group.metrics_urls[0]}/metrics", timeout=10).read().decode()
        for line in ('moeless_expert_model_replicas{kind="shared",model="code"} 1.0',
                     'moeless_expert_model_replicas{kind="own",model="code"} 1.0',
                     'moeless_expert_replica_models{expert="0",layer="1",model="base"} 2.0',
                     "moeless_expert_host_shared_replicas 2.0"):
            assert line in text, line
        assert 'moeless_expert_model_gb_seconds_total{model="chat"}' in text
        assert {(r["layer"], r["expert"]) for r in host["replicas"] if r["bytes"]} == {(1, 0), (1, 3)}
        for c in clients.values():
            c.close()


def test_a_shared_replica_is_evicted_only_when_neither_model_needs_it(family):
    roots = [(name, family[name][1]) for name in ("base", "code")]
    hidden = family["base"][0].spec.hidden_size
    with launch_local_hosts(1, roots, keep_alive_s=1.5, metrics=False) as group:
        base, code = (ExpertHostClient(group.addresses[0], model=name) for name in ("base", "code"))
        resident = lambda: any(r["bytes"] for r in base.status()["replicas"] if (r["layer"], r["expert"]) == (0, 0))
        x = torch.randn(2, hidden)
        base.invoke(0, {0: x})
        code.invoke(0, {0: x})
        assert code.evict(0, 0) is False and resident()  # base used it within the keep-alive
        until = time.monotonic() + 3.0  # twice the keep-alive: code's calls alone keep it
        while time.monotonic() < until:
            code.invoke(0, {0: x})
            assert resident()
            time.sleep(0.25)
        assert base.evict(0, 0) is False  # code used it just now
        deadline = time.monotonic() + 10.0
        while resident() and time.monotonic() < deadline:  # neither calls: the keep-alive takes it
            time.sleep(0.2)
        assert not resident()
        base.close()
        code.close()


def test_one_model_s_loads_never_evict_a_shared_replica_the_other_s_share_protects(family):
    """Room for 3 replicas; base is guaranteed 2 and holds the shared (0, 0) and its own (0, 1); code
    holds its own (0, 1), then loads its (1, 3): its own (0, 1) yields, not the shared replica, though
    that one is code's too."""
    roots = [(name, family[name][1]) for name in ("base", "code")]
    one = _bytes(family["base"][0])
    with launch_local_hosts(1, roots, keep_alive_s=600, metrics=False, memory_bytes=3 * one,
                            shares={"base": 2 * one / 1e9}) as group:
        base, code = (ExpertHostClient(group.addresses[0], model=name) for name in ("base", "code"))
        x = torch.randn(2, family["base"][0].spec.hidden_size)
        base.invoke(0, {0: x, 1: x})
        code.invoke(0, {1: x})
        code.invoke(1, {3: x})
        held = lambda c: {(r["layer"], r["expert"]) for r in c.status()["replicas"] if r["bytes"]}
        assert held(base) == {(0, 0), (0, 1)}
        assert held(code) == {(0, 0), (1, 3)}
        base.close()
        code.close()


def test_a_model_s_wake_set_is_its_experts_not_held_where_another_model_s_are(family):
    stores = ModelStores.open([(name, root) for name, (_, root) in family.items()])
    layers, experts = family["base"][0].spec.num_layers, family["base"][0].spec.num_experts
    base_layer0 = {(0, e) for e in range(experts)}
    assert stores.wake_set(1, base_layer0.__contains__) == [(layers, 1)]  # code's own (0, 1); nothing held in layer 1
    every_base = {(l, e) for l in range(layers) for e in range(experts)}
    assert stores.wake_set(1, every_base.__contains__) == [(layers, 1), (layers + 1, 3)]  # layer order
    assert stores.wake_set(2, every_base.__contains__) == [(2 * layers, 1), (2 * layers + 1, 0)]
    assert stores.wake_set(1, (every_base | {(layers, 1)}).__contains__) == [(layers + 1, 3)]  # held: not again
    assert stores.wake_set(0, {(layers, 1), (layers + 1, 3)}.__contains__) == [(0, 1), (1, 3)]  # base where code is


def test_a_fine_tune_s_first_call_on_a_warm_base_loads_its_own_experts_at_once_into_free_memory_only(family, clock):
    """Base holds layers 0 and 1; code's first call (a shared expert, resident) starts its own (0, 1) and
    (1, 3) with no call to them: code's call of (1, 3) then waits for nothing and is exact. Within the
    keep-alive a later call starts nothing. With room for one more replica only its (0, 1) loads, and
    no base replica is evicted for the wake."""
    stores = ModelStores.open([(name, family[name][1]) for name in ("base", "code")])
    base, code = family["base"][0], family["code"][0]
    layers, experts, one = base.spec.num_layers, base.spec.num_experts, _bytes(base)
    x = torch.randn(3, base.spec.hidden_size)
    for room, woken in ((10 * one, [(layers, 1), (layers + 1, 3)]), (one, [(layers, 1)])):
        rt = ExpertHostRuntime(stores, capacity_bytes=2 * experts * one + room, keep_alive_s=30.0, clock=clock)
        try:
            for layer in range(2):  # the base warm: every expert of layers 0 and 1
                rt.invoke(layer, {e: x for e in range(experts)})
            assert rt.invoke(layers, {0: x}).cold_starts == 0  # code's first call: the shared (0, 0)
            deadline = time.monotonic() + 10.0
            held = lambda: {(r["layer"], r["expert"]) for r in rt.status()["replicas"] if r["state"] in ("idle", "warm")}
            while not set(woken) <= held() and time.monotonic() < deadline:
                time.sleep(0.02)
            assert held() == {(l, e) for l in range(2) for e in range(experts)} | set(woken)  # no base replica evicted
            rows = {(r["layer"], r["expert"]): r for r in rt.status()["replicas"]}
            assert all(rows[key]["loads"] == 1 and rows[key]["cold_starts"] == 0 for key in woken)
            if len(woken) == 2:
                called = rt.invoke(layers + 1, {3: x})
                assert called.cold_starts == 0
                assert torch.equal(called.outputs[3], expert_forward(code.expert_weights(1, 3), x, code.spec.act))
                assert rt.evict(layers + 1, 3)[0]
                rt.invoke(layers, {0: x})  # within the keep-alive: no wake again
                time.sleep(0.3)
                assert (layers + 1, 3) not in held()
        finally:
            rt.close()


def test_a_model_s_family_is_the_models_sharing_a_replica_with_it(family, tmp_path):
    names = ("base", "code", "chat")
    other = export_store(tiny_model("mixtral", 7), "other")  # other weights: no replica in common
    stores = ModelStores.open([*((name, family[name][1]) for name in names), ("other", other)])
    assert [stores.family(m) for m in range(4)] == [frozenset({0, 1, 2})] * 3 + [frozenset({3})]


def test_a_fine_tune_listed_before_its_base_does_not_become_the_base(family):
    """code's store is written over the base's; listed first, the base is still the base: code's own
    (0, 1) maps to the base's (0, 1), and the base's replicas are no fine-tune's own."""
    stores = ModelStores.open([(name, family[name][1]) for name in ("code", "base")])
    layers = family["base"][0].spec.num_layers
    assert [stores.base_of(m) for m in range(2)] == [1, 1]
    assert stores.base_at((0, 1)) == (layers, 1)  # code's own (0, 1) -> the base's, on the base's layers
    assert stores.base_at((layers, 1)) is None and stores.base_at((layers, 0)) is None  # the base's own; a shared one
    alone = ModelStores.open([(name, family[name][1]) for name in ("code", "chat")])  # fine-tunes without their base
    assert alone.family(0) == frozenset({0, 1}) and [alone.base_of(m) for m in range(2)] == [0, 0]  # both over another


def test_a_fine_tune_s_calls_load_and_keep_its_base_whole(family, clock):
    """code replaced the base's (0, 1). Its call of its own (0, 1) once resident loads the base's (0, 1)
    ahead (family warmth: the base whole for the next fine-tune to wake), and while code calls (its
    own (0, 1) only) the base's (0, 0), which the base called once, and (0, 1) outlive the keep-alive.
    With --no-family-warm the base's (0, 1) never loads and its (0, 0) expires; once code stops too,
    everything goes."""
    stores = ModelStores.open([(name, family[name][1]) for name in ("base", "code")])
    assert stores.base_at((base_layers := family["base"][0].spec.num_layers, 1)) == (0, 1)  # code's own (0, 1)
    assert stores.base_at((0, 1)) is None and stores.base_at((0, 0)) is None  # a base's; a shared one
    assert stores.base_at((base_layers, 0)) is None  # not canonical: the base's bytes
    layers, x = base_layers, torch.randn(2, family["base"][0].spec.hidden_size)
    held = lambda rt: {(r["layer"], r["expert"]) for r in rt.status()["replicas"] if r["state"] in ("idle", "warm")}

    def settled(rt, keys, present, timeout_s=10.0):  # the sweeper runs every 1 s of real time at most
        deadline = time.monotonic() + timeout_s
        while (keys <= held(rt) if present else bool(keys & held(rt))) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(1.2)  # one more sweep (or load): what it keeps stays
        return keys <= held(rt) if present else not keys & held(rt)

    for family_warm in (True, False):
        rt = ExpertHostRuntime(stores, capacity_bytes=100 * _bytes(family["base"][0]), keep_alive_s=30.0,
                               clock=clock, family_warm=family_warm)
        try:
            rt.invoke(0, {0: x})  # the base's (0, 0)
            for _ in range(2):  # code's own (0, 1): cold, then resident
                rt.invoke(layers, {1: x})
            for _ in range(3):  # code alone calls, past the base's keep-alive
                clock.advance(20.0)
                rt.invoke(layers, {1: x})
            if family_warm:
                assert settled(rt, {(0, 0), (0, 1), (layers, 1)}, present=True)
                rows = {(r["layer"], r["expert"]): r for r in rt.status()["replicas"]}
                assert rows[(0, 1)]["loads"] == 1 and rows[(0, 1)]["cold_starts"] == 0  # loaded ahead, once
                # Status says which outlive their keep-alive on purpose (the loop's standby counts on them)
                assert rows[(0, 0)]["kept"] and rows[(0, 0)]["idle_s"] >= 60.0 and not rows[(layers, 1)]["kept"]
            else:
                assert settled(rt, {(0, 0), (0, 1)}, present=False) and (layers, 1) in held(rt)
            clock.advance(31.0)  # nobody calls
            assert settled(rt, {(0, 0), (0, 1), (layers, 1)}, present=False)
        finally:
            rt.close()
