"""The host supervisor's restart policy on a fake host group and a fake clock (pure logic; the
real thing, a SIGKILLed host of `moeless serve` coming back, is in test_serve_lifecycle.py)."""

import time

from moeless.serving.supervisor import HostSupervisor, backoff_delay


def test_backoff_doubles_up_to_the_cap():
    assert [backoff_delay(n) for n in range(8)] == [0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 30.0, 30.0]
    assert backoff_delay(3, base_s=0.1, max_delay_s=0.5) == 0.5


class FakeGroup:
    def __init__(self, hosts):
        self.up = [True] * hosts
        self.restarted = []

    def __len__(self):
        return len(self.up)

    def alive(self, i):
        return self.up[i]

    def restart(self, i):
        self.up[i] = True
        self.restarted.append(i)


class FakeClock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def _settle():
    time.sleep(0.05)  # the supervisor thread checks every 0.005 s


def test_a_dead_host_is_restarted_after_a_growing_delay_that_resets_once_stable():
    group, clock = FakeGroup(2), FakeClock()
    supervisor = HostSupervisor(group, check_s=0.005, base_s=1.0, max_delay_s=8.0, stable_s=60.0, clock=clock)
    try:
        for delay in (1.0, 2.0, 4.0):  # dies again at once each time: the delay doubles
            group.up[1] = False
            _settle()
            clock.now += delay - 0.01
            _settle()
            assert not group.up[1], f"restarted before its {delay} s delay"
            clock.now += 0.02
            _settle()
            assert group.up[1]
        assert group.restarted == [1, 1, 1] and supervisor.restarts == [0, 3]
        clock.now += 61.0  # up long enough: the next failure starts from the base delay again
        _settle()
        group.up[1] = False
        _settle()
        clock.now += 1.01
        _settle()
        assert group.up[1] and supervisor.restarts == [0, 4]
    finally:
        supervisor.stop()
    group.up[0] = False
    _settle()
    clock.now += 100
    _settle()
    assert not group.up[0]  # a stopped supervisor restarts nothing (shutdown)


def test_the_supervisor_publishes_a_dead_host_leaving_and_rejoining_the_pool(tmp_path):
    """A dead host leaves the pool at once (no new calls), and re-joins once restarted; published to
    the pool file the serving replicas follow (pool_sources.FileSource)."""
    from moeless.controller.pool.members import Member
    from moeless.controller.pool.sources import FileSource, write_members

    group, clock = FakeGroup(2), FakeClock()
    group.addresses = ["127.0.0.1:1", "127.0.0.1:2"]
    path = tmp_path / "pool.json"
    supervisor = HostSupervisor(group, check_s=0.005, base_s=1.0, clock=clock,
                                publish=lambda members: write_members(path, 2, members))
    source = FileSource.open(str(path))
    try:
        assert source.members() == [Member(0, "127.0.0.1:1"), Member(1, "127.0.0.1:2")]
        group.up[1] = False
        _settle()
        assert source.members()[1] == Member(1, "127.0.0.1:2", ready=False)
        clock.now += 1.01
        _settle()
        assert group.restarted == [1] and source.members()[1].ready
    finally:
        supervisor.stop()
