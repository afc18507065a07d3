"""The cluster's expert hosts as the twin runs them: each GPU's replicas in expert_fn's own replica
table (expert_fn/host/lifecycle.py), so keep-alive and eviction are the hosts' rules, not a copy.

Per GPU one `ReplicaTable` on the twin's clock (`TwinClock`) with `slots x expert_bytes` of memory:
- a replica the current iteration uses is acquired and released at the iteration's start (its
  last use: an idle replica stays `keep_alive_s` after it, then `expire` evicts it);
- a load reserves memory when it begins and evicts idle replicas to make room, least saving per
  GB·s first (LRU where every replica reloads alike), never one the iteration holds;
- each GPU loads one replica after another (`load_s` each): a load issued at t starts when the
  GPU's previous load is done and is done load_s later; it lands (resident) at that time.
A mirror `resident` / `loading` [L, E, G] of the tables' states gives the planners what is resident
(as the loop reads hosts' Status) without walking the tables. The deployment's initial layout
(static EP's, or a planner's fixed one: placement/planner.initial_placement) is resident from the
start (pre-warmed, not counted as loads).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from moeless.expert_fn.errors import HostMemoryFull
from moeless.expert_fn.host.lifecycle import ReplicaTable
from moeless.expert_fn.host.meters import Meters
from moeless.placement.cluster import Cluster
from moeless.controller.planning.rules import resident_placement
from moeless.placement.types import Placement


@dataclass
class TwinClock:
    """The twin's time, which every replica table reads (seconds since the replay began)."""

    now: float = 0.0

    def __call__(self) -> float:
        return self.now


class TwinHosts:
    """G expert hosts' replica tables and load queues (module docstring)."""

    def __init__(self, cluster: Cluster, num_layers: int, num_experts: int, keep_alive_s: float, load_s: float,
                 clock: TwinClock, initial: Placement | None = None) -> None:
        cluster.check_fits(num_layers, num_experts)
        self.clock, self.load_s, self.bytes = clock, load_s, cluster.expert_bytes
        self.num_gpus = cluster.num_gpus
        self.meters = [Meters(clock) for _ in range(cluster.num_gpus)]
        self.tables = [ReplicaTable(int(slots) * cluster.expert_bytes, keep_alive_s, clock, meters)
                       for slots, meters in zip(cluster.slots(), self.meters)]
        shape = (num_layers, num_experts, cluster.num_gpus)
        self.resident = np.zeros(shape, dtype=bool)
        self.loading = np.zeros(shape, dtype=bool)
        self.queue = np.zeros(cluster.num_gpus)  # when each GPU's last issued load is done
        self.ready = np.zeros(shape)  # when each replica's last issued load is done
        self._landing: list[tuple[float, int, int, int]] = []  # (done, layer, expert, gpu)
        initial = initial or Placement.static(num_layers, num_experts, cluster.num_gpus)
        for l, layer in enumerate(initial.layers):
            for e, g in set(zip(layer.expert.tolist(), layer.gpu.tolist())):
                self.tables[g].begin_load((l, e), self.bytes)
                self.tables[g].finish_load((l, e))
                self.resident[l, e, g] = True

    def expire(self) -> np.ndarray:
        """Keep-alive at the clock's time; returns the evictions per layer [L]."""
        evicted = np.zeros(self.resident.shape[0], dtype=np.int64)
        for g, table in enumerate(self.tables):
            for l, e in table.expire():
                self.resident[l, e, g] = False
                evicted[l] += 1
        return evicted

    def land(self, until: float) -> None:
        """Loads done by `until` become resident, in the order they finish."""
        self._landing.sort()
        while self._landing and self._landing[0][0] <= until:
            done, l, e, g = self._landing.pop(0)
            now = self.clock.now
            self.clock.now = done
            self.tables[g].finish_load((l, e))
            self.clock.now = now
            self.loading[l, e, g], self.resident[l, e, g] = False, True

    def _land_gpu(self, gpu: int) -> None:
        """Every load in flight on `gpu` lands now (at its own done time, for the meters)."""
        mine = sorted(x for x in self._landing if x[3] == gpu)
        self._landing = [x for x in self._landing if x[3] != gpu]
        now = self.clock.now
        for done, l, e, g in mine:
            self.clock.now = done
            self.tables[g].finish_load((l, e))
            self.loading[l, e, g], self.resident[l, e, g] = False, True
        self.clock.now = now

    def load(self, layer: int, expert: int, gpu: int, issued: float) -> tuple[float, np.ndarray]:
        """Begin a load issued at `issued` (reserving memory at the clock's time); returns when it is
        done and the evictions per layer [L] it made. RuntimeError when the GPU is full of replicas
        the iteration holds (the plan does not fit its slots). Where loads in flight hold the room,
        they land first (the new load queues behind them anyway) and may then be evicted."""
        try:
            victims = self.tables[gpu].begin_load((layer, expert), self.bytes)
        except HostMemoryFull:
            victims = None
        if victims is None:  # room held by loads still in flight: they land first (the GPU's queue), then go
            self._land_gpu(gpu)
            try:
                victims = self.tables[gpu].begin_load((layer, expert), self.bytes)
            except HostMemoryFull as err:
                raise RuntimeError(f"GPU {gpu} is full of planned replicas: the plan does not fit its slots ({err})") from None
        evicted = np.zeros(self.resident.shape[0], dtype=np.int64)
        for l, e in victims:
            self.resident[l, e, gpu] = False
            evicted[l] += 1
        done = max(self.queue[gpu], issued) + self.load_s
        self.queue[gpu] = self.ready[layer, expert, gpu] = done
        self.loading[layer, expert, gpu] = True
        self._landing.append((done, layer, expert, gpu))
        return done, evicted

    def hold(self, pairs: np.ndarray) -> np.ndarray:
        """Acquire the resident replicas among pairs [n, 3] of (layer, expert, gpu): in use now.
        Returns those acquired (a loading one cannot be, nor evicted): what `release` takes."""
        taken = self._resident(pairs)
        for l, e, g in taken.tolist():
            self.tables[g].acquire((l, e))
        return taken

    def hand_over(self, previous: np.ndarray, pairs: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """The next plan's replicas in use, `previous` (what the last hand-over or `hold` took) still
        held: (taken, dropped), taken those of pairs [n, 3] now resident, acquired where previous did
        not hold them already; dropped the rows of previous not taken now, for `release`. A replica
        held by both stays acquired (hold then release would leave it so), and a plan of 100,000
        replicas that keeps them costs no call per replica."""
        ids = lambda rows: np.ravel_multi_index(rows.T, self.resident.shape) if rows.size else np.zeros(0, np.int64)  # noqa: E731
        taken = self._resident(pairs)
        now_ids, first = np.unique(ids(taken), return_index=True)  # one replica per (layer, expert, gpu), however often listed
        taken, before_ids = taken[first], ids(previous)
        self.hold(taken[~np.isin(now_ids, before_ids)])
        return taken, previous[~np.isin(before_ids, now_ids)]

    def _resident(self, pairs: np.ndarray) -> np.ndarray:
        """The rows of pairs [n, 3] whose replica is resident (a loading or evicted one cannot be used)."""
        return pairs[self.resident[pairs[:, 0], pairs[:, 1], pairs[:, 2]]] if pairs.size else pairs

    def release(self, taken: np.ndarray) -> np.ndarray:
        """Release what `hold` acquired (their last use: the clock's time); returns the evictions
        per layer [L] that were deferred until then (`evict` of a replica in use)."""
        evicted = np.zeros(self.resident.shape[0], dtype=np.int64)
        for l, e, g in taken.tolist():
            if self.tables[g].release((l, e)):
                self.resident[l, e, g] = False
                evicted[l] += 1
        return evicted

    def evict(self, pairs: np.ndarray) -> np.ndarray:
        """Evict the replicas among pairs [n, 3] (a layout that moved away frees them): idle ones
        now, ones in use when their use ends (`release`); returns the evictions made now per layer [L]."""
        evicted = np.zeros(self.resident.shape[0], dtype=np.int64)
        for l, e, g in pairs.tolist():
            if self.resident[l, e, g] and self.tables[g].evict((l, e)):
                self.resident[l, e, g] = False
                evicted[l] += 1
        return evicted

    def held(self) -> np.ndarray:
        """Replicas holding memory (resident or loading) per layer: [L]."""
        return (self.resident | self.loading).sum(axis=(1, 2))

    def placement(self) -> Placement:
        """Every resident or loading replica as a Placement (even shares): what a planner plans
        against; an expert held nowhere counts at its static EP home (the loop's rule:
        controller/planning/rules.resident_placement)."""
        return resident_placement(self.resident | self.loading)

    def gb_s(self) -> float:
        """GB·s every table's meters counted so far (the hosts' own bill)."""
        return sum(meters.totals().gb_s for meters in self.meters)


def pairs_of(placement: Placement) -> np.ndarray:
    """[n, 3] (layer, expert, gpu) of every replica of a placement."""
    rows = [np.stack([np.full(lp.num_replicas, l), lp.expert, lp.gpu], axis=1) for l, lp in enumerate(placement.layers)]
    return np.concatenate(rows).astype(np.int64) if rows else np.zeros((0, 3), np.int64)
