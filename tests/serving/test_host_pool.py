"""Following the expert-host pool (controller/pool/members.py, host_pool.py, sources.py), pure logic on a fake clock.

Pods appear, disappear, restart with new addresses; the executor over the pool uses a host that
joined without a restart, sends no new call to one that left (a call in flight completes), and
reaches a restarted host at its new address; outputs equal the unmodified model's throughout.
Over real host processes and a real API server: tests/k8s/test_pool_apiserver.py.
"""

import threading

import pytest
import torch

from moeless.controller.knobs import KnobError
from moeless.model.tiny import tiny_model
from moeless.serving.executor import RemoteExecutor
from moeless.controller.pool.host_pool import HostPool
from moeless.controller.pool.kube import KubePodSource
from moeless.controller.pool.members import Member, PoolChange, diff, pod_member
from moeless.serving.placement_source import PlacementSource
from moeless.controller.pool.sources import FileSource, StaticSource, pool_source, write_members
from routed_fakes import answer


class FakeHost:
    """A host at `address` computing experts in-process; `gate` (an Event) holds its results back."""

    path = "tcp"  # as a host on another machine: its calls add up each token's first experts

    def __init__(self, model, address):
        self.model, self.address, self.calls, self.closed, self.gate = model, address, 0, False, None

    def submit(self, call, x):
        self.calls += 1
        return _Pending(answer(self.model, call, x), self.gate)

    def status(self):
        return {}

    def close(self):
        self.closed = True


class _Pending:
    def __init__(self, result, gate):
        self._result, self._gate = result, gate

    def result(self):
        if self._gate is not None:
            assert self._gate.wait(10)
        return self._result


@pytest.fixture(scope="module")
def model():
    return tiny_model("mixtral", 0)


def _ids():
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))


def _pool(model, slots=3, retire_s=10.0):
    made = {}

    def make(address):
        made[address] = FakeHost(model, address)
        return made[address]

    return HostPool(slots, make, retire_s), made


def _exact(model, executor):
    torch.testing.assert_close(model.forward(_ids(), executor=executor).logits, model.forward(_ids()).logits,
                               rtol=0, atol=1e-5)


def test_diff_is_a_level_triggered_comparison():
    assert not diff({0: "a:1"}, [Member(0, "a:1")], 3)
    change = diff({0: "a:1", 1: "b:1", 2: "c:1"},
                  [Member(0, "a:2"), Member(1, "b:1", ready=False), Member(3, "d:1")], 3)
    assert change == PoolChange(readdressed={0: "a:2"}, removed=frozenset({1, 2}), ignored=(Member(3, "d:1"),))
    # two members claim slot 0 (an old pod terminating, its successor ready): the ready one wins
    assert diff({}, [Member(0, "b:1"), Member(0, "a:1", ready=False)], 1).added == {0: "b:1"}


def test_pool_follows_pods_appearing_disappearing_and_restarting(model):
    pool, made = _pool(model, retire_s=10.0)
    assert pool.update([Member(0, "a:1")], now=0.0).added == {0: "a:1"}
    assert pool.update([Member(0, "a:1"), Member(1, "b:1")], now=1.0).added == {1: "b:1"}  # scale-out
    assert set(pool.clients()) == {0, 1} and pool.version == 2
    pool.update([Member(0, "a:1"), Member(1, "b:1", ready=False)], now=2.0)  # draining
    assert set(pool.clients()) == {0} and not made["b:1"].closed  # a call in flight may still hold it
    assert pool.not_ready() == {1}  # there, not serving: /healthz says degraded
    pool.update([Member(0, "a:9")], now=3.0)  # restarted at a new address
    assert pool.addresses() == {0: "a:9"} and pool.client(0) is made["a:9"] and not made["a:1"].closed
    pool.update([Member(0, "a:9")], now=12.0)  # retire_s after it left, the drained host's client closes
    assert pool.not_ready() == set()  # gone: taken away on purpose
    assert made["b:1"].closed and not made["a:1"].closed
    pool.update([Member(0, "a:9")], now=13.0)
    assert made["a:1"].closed and pool.version == 4
    pool.close()
    assert made["a:9"].closed


def test_executor_uses_a_host_that_joins_without_restart(model):
    pool, made = _pool(model)
    pool.update([Member(0, "a:1")], now=0.0)
    executor = RemoteExecutor(pool, PlacementSource.static(model.spec.num_layers, model.spec.num_experts, 3))
    _exact(model, executor)  # slots 1 and 2 empty: their experts served by host 0
    assert made["a:1"].calls > 0
    pool.update([Member(0, "a:1"), Member(1, "b:1"), Member(2, "c:1")], now=1.0)
    _exact(model, executor)
    assert made["b:1"].calls > 0 and made["c:1"].calls > 0


def test_slots_follow_the_source_and_the_placement_says_which_a_call_spans(model):
    """maxHosts 2 -> 3 -> 2 while serving: the pool's slots follow; a placement over 2 hosts leaves the
    third slot's host alone until a placement spans it; one over 3 with the slot gone runs on the two."""
    from moeless.placement.types import Placement

    spec = model.spec
    pool, made = _pool(model, slots=2)
    members = [Member(0, "a:1"), Member(1, "b:1"), Member(2, "c:1")]
    pool.update(members, now=0.0)
    assert set(pool.clients()) == {0, 1}  # c is beyond the slots
    placements = PlacementSource.static(spec.num_layers, spec.num_experts, 2)
    executor = RemoteExecutor(pool, placements)
    assert pool.update(members, now=1.0, slots=3).added == {2: "c:1"} and pool.slots == 3
    _exact(model, executor)
    assert made["c:1"].calls == 0 and len(executor.clients) == 3  # not in the placement yet
    placements.set(Placement.static(spec.num_layers, spec.num_experts, 3))
    _exact(model, executor)
    assert made["c:1"].calls > 0
    assert pool.update(members, now=2.0, slots=2).removed == {2} and set(pool.clients()) == {0, 1}
    calls = made["c:1"].calls
    _exact(model, executor)  # the placement still spans 3: slot 2 is evacuated
    assert made["c:1"].calls == calls and executor.dead_hosts == set()


def test_scale_in_drains_a_call_in_flight_completes_exactly(model):
    pool, made = _pool(model)
    pool.update([Member(0, "a:1"), Member(1, "b:1")], now=0.0)
    executor = RemoteExecutor(pool, PlacementSource.static(model.spec.num_layers, model.spec.num_experts, 3))
    made["b:1"].gate = gate = threading.Event()
    out = {}
    forward = threading.Thread(target=lambda: out.setdefault("logits", model.forward(_ids(), executor=executor).logits))
    forward.start()
    while made["b:1"].calls == 0:  # the first layer's call to host 1 is in flight
        forward.join(0.01)
    pool.update([Member(0, "a:1"), Member(1, "b:1", ready=False)], now=1.0)  # host 1 starts draining
    calls = made["b:1"].calls
    gate.set()
    forward.join(10)
    torch.testing.assert_close(out["logits"], model.forward(_ids()).logits, rtol=0, atol=1e-5)
    assert made["b:1"].calls == calls == 1  # the later layers went to host 0 only
    _exact(model, executor)
    assert made["b:1"].calls == 1 and executor.dead_hosts == set()


def test_restarted_host_is_reached_at_its_new_address(model):
    pool, made = _pool(model, slots=2)
    pool.update([Member(0, "a:1"), Member(1, "b:1")], now=0.0)
    executor = RemoteExecutor(pool, PlacementSource.static(model.spec.num_layers, model.spec.num_experts, 2))
    _exact(model, executor)
    pool.update([Member(0, "a:1"), Member(1, "b:2")], now=1.0)
    before = made["b:1"].calls
    _exact(model, executor)
    assert made["b:1"].calls == before and made["b:2"].calls > 0


def test_pod_member_reads_slot_address_and_readiness():
    pod = {"metadata": {"name": "smollm-hosts-2"},
           "spec": {"containers": [{"ports": [{"name": "grpc", "containerPort": 50051}]}]},
           "status": {"podIP": "10.0.0.7", "conditions": [{"type": "Ready", "status": "True"}]}}
    assert pod_member(pod, 1) == Member(2, "10.0.0.7:50051", True)
    assert pod_member({**pod, "metadata": {"name": "smollm-hosts-2", "deletionTimestamp": "x"}}, 1) is None  # leaving
    on_node = {"metadata": {"name": "smollm-hosts-2"}, "status": {"podIP": "fd00::1"}}
    assert pod_member(on_node, 50051, host_network=True) == Member(2, "[fd00::1]:50053", False)
    assert pod_member({"metadata": {"name": "smollm-hosts-2"}, "status": {}}, 1) is None  # no address yet


def test_pool_source_parses_each_form(tmp_path):
    assert pool_source("a:1,b:2") == StaticSource(("a:1", "b:2"))
    assert pool_source("k8s://moeless/smollm:50051?slots=8&hostNetwork=true") == KubePodSource(
        "moeless", "smollm", 50051, 8, True)
    # A policy on an ExpertPool: the pool's pods, its model by the policy's name unless named.
    assert pool_source("k8s://ml/phi:50051?slots=4&pool=shared") == KubePodSource(
        "ml", "phi", 50051, 4, pool="shared", model="phi")
    assert pool_source("k8s://ml/phi:50051?slots=4&pool=shared&model=phi-3.5").model == "phi-3.5"
    # A base whose engine serves fine-tunes too: the names the pool's hosts serve them by, in order.
    assert pool_source("k8s://ml/base:50051?slots=4&pool=shared&model=base&family=code,chat").family == ("code", "chat")
    for bad in ("k8s://moeless/smollm:50051", "k8s://smollm:50051?slots=2", "k8s://ns/p:x?slots=2", "file:///nope",
                "k8s://ml/phi:50051?slots=4&model=phi", "k8s://ml/b:50051?slots=4&family=code",
                "k8s://ml/b:50051?slots=4&pool=p&family=code,,chat"):
        with pytest.raises(KnobError, match="MOELESS_EXPERT_HOSTS"):
            pool_source(bad)
    path = tmp_path / "pool.json"
    write_members(path, 4, [Member(0, "a:1"), Member(3, "d:1", ready=False)])
    source = pool_source(f"file://{path}")
    assert source == FileSource(str(path), 4) and source.members() == [Member(0, "a:1"), Member(3, "d:1", False)]


def test_app_args_and_serve_config_take_a_pool():
    from moeless.serving.config import config_from_args

    config = config_from_args({"hosts": "k8s://moeless/smollm:50051?slots=4", "model": "tiny:mixtral"})
    assert config.pool == KubePodSource("moeless", "smollm", 50051, 4) and config.host_addresses == ()
    assert config.pool_source.slots == 4
    assert config.host_model is None  # its own pool: the hosts' only model
    shared = config_from_args({"hosts": "k8s://ml/phi:50051?slots=4&pool=shared", "model": "tiny:mixtral"})
    assert shared.host_model == "phi"  # addressed by its name on the pool's hosts
    fixed = config_from_args({"hosts": "a:1,b:2", "model": "tiny:mixtral"})
    assert fixed.pool is None and fixed.pool_source == StaticSource(("a:1", "b:2"))
