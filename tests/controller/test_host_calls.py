"""The loop's calls to its hosts (controller/planning/host_calls.py) over fake clients: each host's
actions in the order given, the hosts side by side, a failing host planned around."""

import threading

from moeless.controller.planning.host_calls import host_status, host_statuses, send_actions


class FakeClient:
    def __init__(self, log, fail=False, meet=None):
        self.log, self.fail, self.meet = log, fail, meet  # meet: a barrier the first call waits at

    def _record(self, act, layer, expert):
        if self.meet is not None:
            self.meet.wait(timeout=5)  # broken (an error, the action lost) unless another host's call is in flight
            self.meet = None
        if self.fail:
            raise ConnectionError("host gone")
        self.log.append((act, layer, expert))

    def load(self, layer, expert, wait):
        assert wait is False  # the loop never waits for a load
        self._record("load", layer, expert)

    def evict(self, layer, expert):
        self._record("evict", layer, expert)

    def status(self):
        if self.meet is not None:
            self.meet.wait(timeout=5)  # broken unless another host's Status is in flight
            return {"host": "met"}
        raise TimeoutError("too slow")


class FakePool:
    def __init__(self, clients, slots=4):
        self.clients, self.slots = clients, slots

    def client(self, slot):
        return self.clients.get(slot)


def test_each_hosts_actions_run_in_order_in_a_thread_of_their_own_and_a_dead_host_is_skipped():
    logs, meet = {0: [], 1: [], 2: []}, threading.Barrier(2)
    pool = FakePool({0: FakeClient(logs[0], meet=meet), 1: FakeClient(logs[1], meet=meet),
                     2: FakeClient(logs[2], fail=True)})
    send_actions(pool, [(0, 1, 0, "evict"), (0, 2, 1, "load"), (1, 1, 0, "load"), (0, 3, 2, "load"),
                        (1, 2, 1, "load"), (2, 0, 3, "load")])  # host 3 left the pool: no client
    # hosts 0 and 1 met at the barrier (side by side, not one after another), each in its own order
    assert logs[0] == [("evict", 0, 1), ("load", 1, 1)] and logs[1] == [("load", 0, 2), ("load", 1, 2)]
    assert logs[2] == []
    assert host_status(pool, 0) is None and host_status(pool, 3) is None  # too slow, or no host: planned around


def test_the_hosts_statuses_are_read_side_by_side_in_slot_order():
    meet = threading.Barrier(2)
    pool = FakePool({0: FakeClient([], meet=meet), 1: FakeClient([], meet=meet), 2: FakeClient([])}, slots=4)
    # hosts 0 and 1 answer only if asked at once; host 2 is too slow, slot 3 has no host
    assert host_statuses(pool) == [{"host": "met"}, {"host": "met"}, None, None]
