"""The loop's calls to its hosts (controller/planning/host_calls.py) over fake clients: each host's
actions in the order given, the hosts side by side, a failing host planned around."""

import threading

import numpy as np

from moeless.controller.planning.host_calls import host_status, host_statuses, load_all, send_actions
from moeless.controller.planning.peer_sources import peer_sources


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

    def load(self, layer, expert, wait, source=""):
        assert wait is False  # the loop never waits for a load
        self._record("load" + (f" from {source}" if source else ""), layer, expert)

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

    def addresses(self):
        return {slot: f"10.0.0.{slot}:50051" for slot in self.clients}


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


class WaitingClient:
    """A host whose LoadMany(wait=True) returns once loaded; `meet`: a barrier the call waits at."""

    def __init__(self, meet=None, fail=False):
        self.loaded, self.meet, self.fail, self.sources = [], meet, fail, []

    def load_many(self, replicas, wait, timeout_s, sources=()):
        assert wait is True and timeout_s == 2.0  # a widening waits for its loads, bounded
        self.sources.append(list(sources))
        if self.fail:
            raise RuntimeError("replica cannot load")
        if self.meet is not None:
            self.meet.wait(timeout=5)  # broken unless the other host's call is in flight at once
        self.loaded.append(list(replicas))
        return len(replicas) - 1  # one of them was resident already


def test_load_all_sends_one_waiting_call_per_host_the_hosts_side_by_side():
    meet = threading.Barrier(2)
    pool = FakePool({0: WaitingClient(meet), 1: WaitingClient(meet)})
    assert load_all(pool, [(0, 0, 0), (1, 0, 1), (0, 1, 0), (1, 1, 1)], timeout_s=2.0) == 2  # the loads started
    assert pool.clients[0].loaded == [[(0, 0), (0, 1)]] and pool.clients[1].loaded == [[(1, 0), (1, 1)]]
    assert load_all(pool, [], timeout_s=2.0) == 0


def test_load_all_is_false_where_a_host_fails_or_left():
    assert load_all(FakePool({0: WaitingClient(fail=True)}), [(0, 0, 0)], timeout_s=2.0) is None
    assert load_all(FakePool({0: WaitingClient()}), [(0, 0, 0), (0, 0, 2)], timeout_s=2.0) is None  # slot 2: no host


def test_a_load_copies_from_a_peer_holding_its_replica_the_copies_spread_over_the_holders():
    logs = {0: [], 1: [], 2: []}
    pool = FakePool({g: FakeClient(logs[g]) for g in logs})
    resident = np.zeros((2, 4, 4), bool)
    resident[0, 1, [0, 1]] = True  # hosts 0 and 1 hold (0, 1); nobody holds (1, 2)
    send_actions(pool, [(0, 1, 2, "load"), (1, 2, 2, "load"), (0, 1, 1, "evict")], resident)
    assert logs[2] == [("load from 10.0.0.0:50051", 0, 1), ("load", 1, 2)]  # (1, 2) from its store
    send_actions(pool, [(0, 1, 2, "load")])  # no view of the hosts yet: the store
    assert logs[2][-1] == ("load", 0, 1)
    pool = FakePool({g: WaitingClient() for g in range(4)})
    assert load_all(pool, [(0, 1, 2), (0, 1, 3), (1, 2, 3)], timeout_s=2.0, resident=resident) == 1  # the fake: one resident a host
    assert pool.clients[2].sources == [["10.0.0.0:50051"]]  # host 0 gave one copy: host 1 gives the next
    assert pool.clients[3].sources == [["10.0.0.1:50051", ""]]
    assert load_all(pool, [(1, 2, 0)], timeout_s=2.0, resident=resident) == 0
    assert pool.clients[0].sources == [[]]  # none from a peer: no sources sent


def test_peer_sources_golden():
    resident = np.zeros((1, 2, 4), bool)
    resident[0, 1, :2] = True
    assert peer_sources([(0, 1, 2), (0, 1, 3), (0, 0, 3)], resident) == [0, 1, None]
    assert peer_sources([(0, 1, 0), (0, 1, 2)], resident) == [1, 0]  # never itself; 1 gave one, 0 none: 0
    assert peer_sources([], resident) == []
