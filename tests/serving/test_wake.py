"""Waking a pool scaled to zero (controller/pool/wake.py): the pure decision and the Waker on a fake clock."""

from __future__ import annotations

import pytest

from moeless.controller.knobs import KnobError
from moeless.controller.pool.kube import KubePodSource
from moeless.controller.pool.sources import StaticSource
from moeless.controller.pool.wake import PoolDidNotWake, Waker, health_word, wake_value, waker_for


@pytest.mark.parametrize("annotation, woken_by, wakes", [
    (None, None, True),  # never woken
    ("100.000", "100.000", True),  # the last wake was taken long ago
    ("998.000", "998.000", False),  # another replica woke it 2 s ago (the operator already took it)
    ("998.000", None, False),  # a wake is pending: the operator has not acted yet
    ("400.000", "300.000", False),  # pending, however old: another write would not help
    ("by-hand", "by-hand", True),  # a value a person set (not a time) and taken
])
def test_wake_value_lets_one_write_through(annotation, woken_by, wakes):
    assert wake_value(1000.0, annotation, woken_by, 5.0) == ("1000.000" if wakes else None)
    assert wake_value(1000.0, annotation, woken_by, 5.0, starting=True) is None  # pods starting: it is waking


def test_pods_starting_slowly_are_not_woken_again():
    clock = Clock()
    policy = Policy(clock, delay_s=60.0)
    w = waker(policy, clock)

    def starting() -> bool:  # the operator takes the wake at once; its pods then start for 60 s
        policy.woken_by = policy.annotation
        return bool(policy.writes)

    w.wait_for_hosts(policy.has_hosts, starting)
    assert policy.writes == ["1000.000"] and w.last_wake_s == pytest.approx(60.0)


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        self.now += s


class Policy:
    """A policy the fake operator wakes `delay_s` after the annotation changes (hosts ready then)."""

    name = "ns/tiny"

    def __init__(self, clock: Clock, delay_s: float | None):
        self.clock, self.delay_s = clock, delay_s
        self.annotation = self.woken_by = None
        self.reads, self.writes, self.ready_at = 0, [], None

    def read(self):
        self.reads += 1
        return self.annotation, self.woken_by

    def write(self, value: str) -> None:
        self.writes.append(value)
        self.annotation = value
        if self.delay_s is not None:
            self.ready_at = self.clock.now + self.delay_s

    def has_hosts(self) -> bool:
        return self.ready_at is not None and self.clock.now >= self.ready_at


def waker(policy: Policy, clock: Clock, timeout_s: float = 180.0) -> Waker:
    return Waker(policy, timeout_s, min_interval_s=5.0, poll_s=0.5, clock=clock, wall=lambda: 1000.0 + clock.now,
                 sleep=clock.sleep)


def test_a_call_finding_the_pool_empty_wakes_it_once_and_waits_for_a_host():
    clock = Clock()
    policy = Policy(clock, delay_s=12.0)
    w = waker(policy, clock)
    w.wait_for_hosts(policy.has_hosts)
    assert policy.writes == ["1000.000"]  # one write, though the wait polled 24 times
    assert policy.reads <= 3  # the policy read at most once per 5 s
    assert w.stats() == {"waking": False, "wakes": 1, "writes": 1, "last_wake_s": pytest.approx(12.0)}
    w.wait_for_hosts(policy.has_hosts)  # hosts there: no wait, no write
    assert w.wakes == 1 and len(policy.writes) == 1


def test_a_pool_that_does_not_wake_fails_the_call_naming_what_to_check_then_the_next_call_wakes_again():
    clock = Clock()
    policy = Policy(clock, delay_s=None)  # no operator
    w = waker(policy, clock, timeout_s=30.0)
    what = r"ns/tiny did not wake within 30 s .*operator.*wokenBy.*moeless.io/policy=tiny"
    with pytest.raises(PoolDidNotWake, match=what):
        w.wait_for_hosts(policy.has_hosts)
    assert policy.writes == ["1000.000"] and not w.waking  # pending all along: written once
    policy.woken_by = policy.annotation  # an operator took it, but the pool is still empty
    with pytest.raises(PoolDidNotWake):
        w.wait_for_hosts(policy.has_hosts)
    assert policy.writes == ["1000.000", "1030.000"]


def test_an_api_error_is_retried_and_named_in_the_503():
    clock = Clock()
    policy = Policy(clock, delay_s=None)

    def forbidden():
        err = PermissionError()
        err.status, err.reason = 403, "Forbidden"  # as kubernetes.client.ApiException has them
        raise err

    policy.read = forbidden
    with pytest.raises(PoolDidNotWake, match=r"last error: PermissionError: Forbidden \(serving's service account "
                                             r"needs get and patch on expertautoscalingpolicies\)"):
        waker(policy, clock, timeout_s=20.0).wait_for_hosts(policy.has_hosts)


def test_only_a_kubernetes_pool_is_woken_and_the_timeout_knob_is_checked(monkeypatch):
    kube = KubePodSource("ns", "tiny", 50051, 3)
    assert waker_for(StaticSource(("a:1",))) is None
    assert waker_for(kube).timeout_s == 180.0 and waker_for(kube).target.name == "ns/tiny"
    shared = waker_for(KubePodSource("ns", "tiny", 50051, 3, pool="shared", model="tiny")).target
    assert (shared.name, shared.plural, shared.selector) == ("ns/shared", "expertpools", "moeless.io/pool=shared")
    monkeypatch.setenv("MOELESS_WAKE_TIMEOUT_S", "30")
    assert waker_for(kube).timeout_s == 30.0
    monkeypatch.setenv("MOELESS_WAKE_TIMEOUT_S", "soon")
    with pytest.raises(KnobError, match="MOELESS_WAKE_TIMEOUT_S: 'soon'"):
        waker_for(kube)


def test_healthz_says_waking():
    base = {"draining": False, "live_hosts": [], "hosts": 0}
    assert health_word({**base, "waking": True}) == (503, "waking")
    assert health_word(base) == (503, "no expert host is serving")
    assert health_word({**base, "live_hosts": [0], "hosts": 2}) == (200, "degraded")
    assert health_word({**base, "draining": True, "waking": True}) == (503, "draining")
