"""RemoteExecutor: the serverless ExpertExecutor, running each MoE layer's experts on expert hosts.

Per layer: read the current placement (it may change between iterations), scatter the routed
tokens to the hosts that hold the experts' replicas, one routed call per host (each token once,
in the model's dtype, with its experts and gate weights), all hosts in parallel (each client's
submit returns at once: shared memory for hosts on this machine, the TCP channel for hosts on
other machines, gRPC where a host offers neither), then gather the hosts' combined rows
(moeless.serving.scatter).

The hosts are a HostPool (controller/pool/host_pool.py): slot i is GPU i of the placement; a slot with no
ready host in it (scaled in, draining, not started yet) is treated like a dead host, and a host
that joins the pool is called from the next layer on. The placement says how many hosts a call
spans (its GPU count): a pool that grew (maxHosts raised) serves from its new slots once a
placement spans them, and a placement wider than the pool evacuates the slots it lacks. Each
layer call takes the pool's clients once, so a call in flight when the pool changes completes on the hosts it started with.

Faults: an ExpertHostUnavailable marks that host dead and the layer is re-run with the dead
hosts' replicas moved to live hosts (they load there on demand, a cold start). A dead host is
probed again every `probe_after_s` and rejoins once it answers (after a restart). When no host
is live the layer raises NoLiveHostError, which the HTTP ingress turns into a 503 (a pool that can be
woken, on Kubernetes, is woken first and the call held meanwhile: controller/pool/wake.py). A
ReplicaLoadError (corrupt weights) is not a host fault: it propagates with the file's name.
"""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from contextlib import ExitStack
from dataclasses import dataclass
from typing import Callable, Protocol, Sequence

import torch

from moeless.expert_fn.errors import ExpertHostUnavailable
from moeless.expert_fn.wire.routed import Pending, RoutedCall
from moeless.model.interface import Routing
from moeless.controller.pool.host_pool import HostPool
from moeless.placement.types import LayerPlacement
from moeless.serving.pingpong import waiting
from moeless.serving.placement_source import PlacementSource
from moeless.serving.scatter import MIN_CHUNK, evacuate, gather, plan_scatter
from moeless.controller.pool.wake import Waker


class HostClient(Protocol):
    """What the executor needs of moeless.expert_fn.client.client.ExpertHostClient (any transport)."""

    def submit(self, call: RoutedCall, x: torch.Tensor) -> Pending:
        """Start the routed call on x[call.tokens]; returns at once. Pending.result() -> RoutedResult
        (z: [n_out, H]); ExpertHostUnavailable = host down."""
        ...

    def status(self) -> dict: ...

    @property
    def path(self) -> str:
        """The data path calls take: "local" (shared memory), "tcp", "nixl", "grpc" or "unopened" (not called yet)."""
        ...


@dataclass
class LayerTimes:
    """Accumulated wall time of the executor's steps over all layers run (seconds).

    scatter_s: planning + packing the hosts' rows (into shared memory or a message) and sending;
    invoke_s: waiting for the parallel host calls (transfer + expert compute + RPC); compute_s: per layer the slowest host's own compute time (the part
    of invoke_s that is expert compute on the critical path); compute_sum_s: all hosts' compute;
    gather_s: reassembly and combine; tokens_moved: (token, expert) pairs the hosts computed;
    rows_sent / rows_received: token rows that crossed to the hosts and back; bytes_sent /
    bytes_received: the routed calls' frames each way, whatever the transport; cold_starts:
    replicas loaded on demand; baton_s: with micro-batches (pingpong.py), a layer's gathered
    output waiting while the other micro-batch computed.
    """

    layers: int = 0
    scatter_s: float = 0.0
    invoke_s: float = 0.0
    compute_s: float = 0.0
    compute_sum_s: float = 0.0
    gather_s: float = 0.0
    tokens_moved: int = 0
    rows_sent: int = 0
    rows_received: int = 0
    bytes_sent: int = 0
    bytes_received: int = 0
    cold_starts: int = 0
    retries: int = 0
    baton_s: float = 0.0

    def as_dict(self) -> dict:
        return {"layers": self.layers, "scatter_s": self.scatter_s, "invoke_s": self.invoke_s,
                "compute_s": self.compute_s, "compute_sum_s": self.compute_sum_s, "gather_s": self.gather_s,
                "tokens_moved": self.tokens_moved, "rows_sent": self.rows_sent, "rows_received": self.rows_received,
                "bytes_sent": self.bytes_sent, "bytes_received": self.bytes_received,
                "cold_starts": self.cold_starts, "retries": self.retries, "baton_s": self.baton_s}


# (layer, its placement after fault evacuation, the gate's routing, the hosts it spans) -> the placement to scatter by
Relevel = Callable[[int, LayerPlacement, Routing, int], LayerPlacement]


@dataclass(frozen=True)
class LayerCall:
    """One layer call: the placement it scattered by, over num_hosts hosts; per host called, its
    (experts, rows per expert) and its compute seconds (the host's clock); replicas loaded on demand."""

    placement: LayerPlacement
    batches: dict[int, tuple[list[int], list[int]]]
    compute_s: dict[int, float]
    cold_starts: int
    num_hosts: int


class RemoteExecutor:
    """ExpertExecutor over expert hosts: a HostPool, or a fixed list (client i is GPU i of the placement)."""

    def __init__(self, clients: Sequence[HostClient] | HostPool, source: PlacementSource, *, probe_after_s: float = 1.0,
                 clock: Callable[[], float] = time.monotonic, relevel: Relevel | None = None,
                 waker: Waker | None = None):
        self.pool = clients if isinstance(clients, HostPool) else HostPool.fixed(list(clients))
        if self.pool.slots != source.placement.num_gpus:
            raise ValueError(f"the placement spans {source.placement.num_gpus} expert hosts but the pool has "
                             f"{self.pool.slots} slots; pass one client per host (a pool: one slot per host)")
        self.source = source
        self.probe_after_s = probe_after_s
        self.clock = clock
        self.times = LayerTimes()
        self.waker = waker  # holds a call that finds the pool empty while it wakes (controller/pool/wake.py)
        self.relevel = relevel  # shares re-levelled per call on the layer's actual loads (the live loop)
        self.split_experts = True  # False: every expert's tokens on one host (hosts not split-exact: scatter.py)
        self._calls = threading.local()  # .last: this thread's last layer call (a micro-batch's own)
        self._dead: dict[int, tuple[float, HostClient]] = {}  # slot -> (when marked dead, the client that failed)
        self._lock = threading.Lock()
        self._slots = defaultdict(threading.Lock)  # slot -> held from a call's submit to its gather

    @property
    def clients(self) -> list[HostClient | None]:
        """Per slot, the client of its ready host now (None: the slot is empty)."""
        now = self.pool.clients()
        return [now.get(i) for i in range(self.pool.slots)]

    @property
    def dead_hosts(self) -> set[int]:
        with self._lock:
            return set(self._dead)

    @property
    def last_call(self) -> LayerCall | None:
        """The figures of this thread's last layer call (the live loop reports them); per thread, so
        each micro-batch reads its own."""
        return getattr(self._calls, "last", None)

    @last_call.setter
    def last_call(self, call: LayerCall | None) -> None:
        self._calls.last = call

    def run_layer(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x: [T, H] -> [T, H], sum_j weight[t, j] * expert(layer, idx[t, j])(x[t]), on the hosts;
        x may be on a GPU (a replica there): the answer is on x's device."""
        routing = routing.on_cpu()  # the scatter is planned in numpy
        if self.waker is not None:
            self.waker.wait_for_hosts(lambda: bool(self.pool.clients()), lambda: bool(self.pool.not_ready()))
        self._probe_dead()
        while True:  # each failure marks more live hosts dead; evacuate raises once none is left
            clients = self.pool.clients()  # this call's hosts, whatever the pool does meanwhile
            try:
                return self._run_once(layer, x, routing, clients)
            except _HostsDown as down:
                with self._lock:
                    self._dead.update({h: (self.clock(), clients[h]) for h in down.hosts})
                self.times.retries += 1

    def close(self) -> None:
        """Nothing of its own to release (the clients belong to the caller)."""

    def _run_once(self, layer: int, x: torch.Tensor, routing: Routing, clients: dict[int, HostClient]) -> torch.Tensor:
        # 1. The placement of this iteration, with the replicas of dead hosts and empty slots moved to live ones.
        start = time.perf_counter()
        placement, num_hosts = self.source.layer(layer)
        dead = self.dead_hosts | (set(range(num_hosts)) - set(clients))
        if dead:
            placement = evacuate(placement, dead, num_hosts)
        if self.relevel is not None:
            placement = self.relevel(layer, placement, routing, num_hosts)
        if x.shape[0] == 0:
            return torch.zeros_like(x)
        # 2. Scatter: each expert's tokens split over its replicas, one routed call per host.
        x = x.contiguous()
        plan = plan_scatter(layer, routing.idx, routing.weight.to(x.dtype), placement,
                            MIN_CHUNK if self.split_experts else None)
        # 3. One packed call per host, all in flight at once; then wait for every one of them
        #    (always all: a call left uncollected would hold its client). A host's slot stays held
        #    until its answer is gathered: the answer lies in its channel's buffer, which another
        #    micro-batch's call on that host would overwrite (pingpong.py).
        pending, results, down, failure = {}, {}, [], None
        slots = ExitStack()
        try:
            for h in sorted(plan.hosts):  # one order for every thread: no deadlock between them
                slots.enter_context(self._slots[h])
            for h, batch in plan.hosts.items():
                try:
                    pending[h] = clients[h].submit(batch.call, x)
                except ExpertHostUnavailable:
                    down.append(h)
                except Exception as err:  # e.g. no NIXL link: the calls in flight are still collected below
                    failure = err
                    break
        finally:
            scattered = time.perf_counter()
            with waiting() as handed_over:  # another micro-batch computes meanwhile; this one gathers when it can
                try:
                    for h, call in pending.items():
                        try:
                            results[h] = call.result()
                        except ExpertHostUnavailable:
                            down.append(h)
                        except Exception as err:  # e.g. ReplicaLoadError: raised once every call is back
                            failure = failure or err
                    invoked = time.perf_counter()
                    # 4. Gather: the hosts' rows into each token's combine slots, added in the reference's order.
                    out = None
                    if failure is None and not down:
                        z = {h: r.z for h, r in results.items()}
                        if not x.is_cpu:  # a GPU replica's answers: on its GPU (CUDA IPC, NIXL) or in host memory
                            z = {h: rows.to(x.device) for h, rows in z.items()}
                        out = gather(plan, z, x.shape[1], x.dtype, x.device)
                    done = time.perf_counter()
                finally:
                    slots.close()  # before the baton comes back: the micro-batch holding it may wait for these
            resumed = time.perf_counter()
        if failure is not None:
            raise failure
        if down:
            raise _HostsDown(down)
        t = self.times
        t.layers += 1
        t.scatter_s += scattered - start
        t.invoke_s += invoked - scattered
        t.gather_s += done - invoked
        t.baton_s += (resumed - done) if handed_over else 0.0
        t.compute_s += max((r.compute_s for r in results.values()), default=0.0)
        t.compute_sum_s += sum(r.compute_s for r in results.values())
        cold_starts = sum(r.cold_starts for r in results.values())
        t.cold_starts += cold_starts
        t.tokens_moved += int(routing.idx.numel())
        for batch in plan.hosts.values():
            t.rows_sent += int(batch.call.tokens.numel())
            t.rows_received += batch.call.n_out
            t.bytes_sent += batch.call.request_bytes(x.shape[1], x.dtype)
            t.bytes_received += batch.call.reply_bytes(x.shape[1], x.dtype)
        self.last_call = LayerCall(placement, {h: (b.experts, b.counts) for h, b in plan.hosts.items()},
                                   {h: r.compute_s for h, r in results.items()}, cold_starts, num_hosts)
        return out

    def _probe_dead(self) -> None:
        """Ask hosts dead for at least probe_after_s whether they are back (a restart). A dead
        slot that the pool emptied or gave a new client (a new address) is no longer watched."""
        now = self.clock()
        with self._lock:
            dead = sorted(self._dead.items(), key=lambda item: item[0])
        for host, (since, client) in dead:
            if self.pool.client(host) is not client:
                with self._lock:
                    self._dead.pop(host, None)
                continue
            if now - since < self.probe_after_s:
                continue
            try:
                client.status()
            except ExpertHostUnavailable:
                with self._lock:
                    self._dead[host] = (now, client)
                continue
            with self._lock:
                self._dead.pop(host, None)


class _HostsDown(Exception):
    def __init__(self, hosts: list[int]):
        self.hosts = hosts
