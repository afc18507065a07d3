"""RemoteExecutor's fault handling and placement reading, over in-process fake hosts (pure logic).

The same properties over real expert-host processes are in test_remote_exactness.py/test_faults.py.
"""

import numpy as np
import pytest
import torch

from moeless.expert_fn.errors import ExpertHostError, ExpertHostUnavailable
from moeless.model.tiny import tiny_model
from moeless.placement.types import LayerPlacement, Placement
from moeless.serving.executor import RemoteExecutor
from moeless.serving.placement_source import PlacementSource
from moeless.controller.pool.members import NoLiveHostError
from routed_fakes import answer


class FakeHost:
    """Computes experts in-process; records what it received; can be 'killed'."""

    path = "tcp"  # as a host on another machine: its calls add up each token's first experts

    def __init__(self, model):
        self.model, self.down, self.seen = model, False, []

    def submit(self, call, x):
        if self.down:
            raise ExpertHostUnavailable("fake host is down")
        self.seen.append((call.layer, list(call.experts)))
        return _Done(answer(self.model, call, x))

    def status(self):
        if self.down:
            raise ExpertHostUnavailable("fake host is down")
        return {}


class _Done:
    def __init__(self, result):
        self._result = result

    def result(self):
        return self._result


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return tiny_model("mixtral", 0)


def _ids():
    return torch.randint(0, 128, (2, 9), generator=torch.Generator().manual_seed(1))


def _replicated(spec, hosts):
    """Every expert with two replicas on different hosts, uneven shares."""
    expert = np.repeat(np.arange(spec.num_experts), 2)
    gpu = (np.arange(expert.size) + expert) % hosts
    share = np.tile([0.3, 0.7], spec.num_experts)
    return Placement(tuple(LayerPlacement(expert, gpu, share) for _ in range(spec.num_layers)), spec.num_experts, hosts)


def test_fake_hosts_reproduce_reference_and_read_placement_changes(model):
    ref = model.forward(_ids()).logits
    source = PlacementSource.static(model.spec.num_layers, model.spec.num_experts, 3)
    hosts = [FakeHost(model) for _ in range(3)]
    executor = RemoteExecutor(hosts, source)
    torch.testing.assert_close(model.forward(_ids(), executor=executor).logits, ref, rtol=0, atol=1e-5)
    source.set(_replicated(model.spec, 3))
    assert source.version == 1
    torch.testing.assert_close(model.forward(_ids(), executor=executor).logits, ref, rtol=0, atol=1e-5)
    # with two replicas per expert spread over hosts, every host received experts
    assert all(h.seen for h in hosts)


def test_dead_host_is_evacuated_then_probed_back(model):
    ref = model.forward(_ids()).logits
    clock = FakeClock()
    hosts = [FakeHost(model) for _ in range(2)]
    executor = RemoteExecutor(hosts, PlacementSource.static(model.spec.num_layers, model.spec.num_experts, 2),
                              probe_after_s=5.0, clock=clock)
    hosts[1].down = True
    torch.testing.assert_close(model.forward(_ids(), executor=executor).logits, ref, rtol=0, atol=1e-5)
    assert executor.dead_hosts == {1} and executor.times.retries == 1
    # back up, but not probed before probe_after_s
    hosts[1].down = False
    hosts[1].seen.clear()
    clock.now = 4.0
    model.forward(_ids(), executor=executor)
    assert executor.dead_hosts == {1} and not hosts[1].seen
    clock.now = 6.0
    torch.testing.assert_close(model.forward(_ids(), executor=executor).logits, ref, rtol=0, atol=1e-5)
    assert executor.dead_hosts == set() and hosts[1].seen


def test_all_hosts_dead_raises_no_live_host(model):
    hosts = [FakeHost(model) for _ in range(2)]
    for h in hosts:
        h.down = True
    executor = RemoteExecutor(hosts, PlacementSource.static(model.spec.num_layers, model.spec.num_experts, 2))
    with pytest.raises(NoLiveHostError, match="expert hosts"):
        model.forward(_ids(), executor=executor)


def test_client_count_must_match_placement(model):
    with pytest.raises(ValueError, match="one client per host"):
        RemoteExecutor([FakeHost(model)], PlacementSource.static(2, 4, 2))


class RefusingHost(FakeHost):
    """A host whose client cannot send at all (as a NIXL link that cannot register its buffer)."""

    def submit(self, call, x):
        raise ExpertHostError("TCP channel 10.0.0.1:7000: no NIXL link on cuda:0: registering failed")


def test_a_call_that_cannot_be_sent_raises_its_own_error_and_every_sent_call_is_collected(model):
    """Seen on an H200: the submit's error was masked by a KeyError from the gather."""
    hosts = [FakeHost(model), RefusingHost(model)]
    executor = RemoteExecutor(hosts, PlacementSource.static(model.spec.num_layers, model.spec.num_experts, 2))
    with pytest.raises(ExpertHostError, match="no NIXL link on cuda:0"):
        model.forward(_ids(), executor=executor)
    assert hosts[0].seen and executor.dead_hosts == set()  # not marked dead: it is up, the path is not
