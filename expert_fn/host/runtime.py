"""The expert host's engine, without the network: replicas, loads off the request path, invokes.

Thread-safe: gRPC handler threads call load / evict / invoke / status concurrently. A load goes
through the weight tiers (expert_fn/stores/tiers.py: disk -> host memory, sha256 checked once, on
entry -> device), or copies the replica from a peer host that holds it (peer_copy.py), on a few load
workers (a call's loads first: load_queue.py), so a pre-warm or prefetch returns at once; an invoke
needing a replica still loading waits for it (a cold start); a load running is never started twice.
Per layer the meters count the cold-start time a prefetch hid and the time calls waited; a sweeper
evicts replicas idle past keep_alive_s.

Models whose experts are the same bytes share one replica: every key is mapped to its canonical
replica first (model_stores.py), so all below works per content key; an Evict leaves a replica
another model used within the keep-alive (meters.py bills it among them). A model's first call in a
keep-alive prefetches its experts where the host holds another model's (ModelStores.wake_set), into
free memory only, and while a fine-tune calls its base stays whole (model_calls.py's family warmth).

The compute dtype is float32 by default: every model's outputs then equal the float32 reference
(model/moe_model.py) bit for bit, a LoRA fine-tune's too (its factors applied over the shared replica
at call time: adapters.py). compute_dtype="store" computes in the store's own dtype (half the memory
in bfloat16, a GPU's bfloat16 tensor cores): outputs equal the reference to that dtype's rounding.

An invoke's compute_s is the compute thread's CPU time on a CPU device computing on one torch thread
(time preempted by other processes is not the host's work), else wall time (GPU kernels, OpenMP).
"""

from __future__ import annotations

import logging
import threading
import time
from dataclasses import asdict
from concurrent.futures import Future
from typing import Callable

import torch

from moeless.expert_fn.wire.codec import InvokeResult
from moeless.expert_fn.errors import BadRequest, ReplicaLoadError
from moeless.expert_fn.host.adapters import bytes_by_model, device_loras, lora_forward
from moeless.expert_fn.host.executor import Weights, compute_clock, forward_for
from moeless.expert_fn.host.lifecycle import RESIDENT, Key, ReplicaState, ReplicaTable
from moeless.expert_fn.host.load_queue import LoadQueue
from moeless.expert_fn.host.meters import Meters
from moeless.expert_fn.host.model_calls import ModelCalls
from moeless.expert_fn.host.peer_copy import PeerCopies
from moeless.expert_fn.stores.model_stores import ModelRange, as_model_stores
from moeless.expert_fn.host.shares import Shares
from moeless.expert_fn.stores.tiers import DeviceCopier, HostTier, TierConfig, compute_dtype_of
from moeless.model.weight_store import WeightStore, WeightStoreError, stored_dtype

log = logging.getLogger(__name__)


class ExpertHostRuntime:
    """Replicas of (layer, expert) FFNs from `store` (a WeightStore, or model_stores.ModelStores: several
    models in one layer space), computed on `device` in float32 or (compute_dtype="store") the store's dtype."""

    def __init__(
        self,
        store: WeightStore,
        *,
        device: str = "cpu",
        capacity_bytes: int,
        keep_alive_s: float,
        clock: Callable[[], float] = time.monotonic,
        load_workers: int = 2,
        tier: TierConfig = TierConfig(),
        shares: Shares | None = None,
        compute_dtype: str = "float32",
        family_warm: bool = True,
        peer_copies: str | PeerCopies = "measured",
    ) -> None:
        self.dtype = compute_dtype_of(store, compute_dtype)  # options.COMPUTE_DTYPES
        self.models = as_model_stores(store)  # each host layer's model; each key's canonical replica
        self.device = device
        self.tier = HostTier(self.models, tier, pin=device.startswith("cuda") and torch.cuda.is_available())
        self._copier = DeviceCopier(device, self.dtype)
        self.peers = peer_copies if isinstance(peer_copies, PeerCopies) else PeerCopies(peer_copies, device)
        self.keep_alive_s = keep_alive_s
        self.health = "starting"  # "serving" once the server listens, "draining" on SIGTERM
        self._forward = forward_for(device, exact=self.dtype == torch.float32)  # float32: the reference's bits
        self._lock = threading.Lock()
        self.meters = Meters(clock, keep_alive_s, users=self.models.users)
        self.table = ReplicaTable(capacity_bytes, keep_alive_s, clock, self.meters, shares)
        self._weights: dict[Key, Weights] = {}
        self._loads: dict[Key, Future] = {}
        self._ahead: set[Key] = set()  # loaded or loading ahead of any invocation (prefetch, pre-warm)
        self._inflight = 0
        self._loras: dict[Key, Weights] = {}  # host key -> its LoRA factors on the device (adapters.py)
        self.calls = ModelCalls(self.models, family_warm)  # wake-ups, family warmth
        self._hold_loras()
        self._pool = LoadQueue(load_workers, "expert-load")  # a call's loads before prefetches
        self._stop = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep, name="keep-alive", daemon=True)
        self._sweeper.start()
        if tier.prewarm != "none":
            threading.Thread(target=self.tier.prewarm, name="host-tier-prewarm", daemon=True).start()

    def load(self, layer: int, expert: int, wait: bool = False, source: str = "") -> tuple[ReplicaState, bool]:
        """Pre-warm or prefetch (layer, expert) -> (its state, whether this call started a load; a resident
        one's keep-alive starts over); wait=True blocks until resident, raises ReplicaLoadError if it fails.
        source: a peer host's address that holds it resident, copied from where the host tier lacks it."""
        key, model = self.models.check(layer, expert)
        with self._lock:
            self.table.touch(key)
            future, started = self._start_load(key, model, source=source)
            if started:
                self._ahead.add(key)
        if wait and future is not None:
            future.result()
        with self._lock:
            return self.table.state(key), started

    def evict(self, layer: int, expert: int) -> tuple[bool, ReplicaState]:
        """Evict now if idle and no other model used it within the keep-alive (a shared replica it
        still needs stays); returns (evicted, state afterwards)."""
        key, model = self.models.check(layer, expert)
        with self._lock:
            if set(self.meters.needed_by(key)) - {model}:
                return False, self.table.state(key)
            evicted = self.table.evict(key)
            if evicted:
                self._dropped([key])
            return evicted, self.table.state(key)

    def invoke(self, layer: int, batches: dict[int, torch.Tensor], on_device: bool = False,
               out: torch.Tensor | None = None) -> InvokeResult:
        """Run every expert's tokens of one layer in one go. batches: expert -> [n, H], any float dtype, on
        the CPU or the compute device; outputs: expert -> [n, H] in self.dtype, on the CPU, or with on_device
        where the host computes (routed.run_routed combines there). out: [sum of n, H] in self.dtype on the
        device (on_device): the outputs written into its consecutive slices, in batches' order. Raises
        ReplicaLoadError (naming the file) if any expert fails to load."""
        resolved = {expert: self.models.check(layer, expert) for expert in batches}  # (replica, its model) each
        for expert, x in batches.items():
            if x.dim() != 2:
                raise BadRequest(f"expert {expert}: tokens must be [n, H], got shape {list(x.shape)}")
        out_device = self.device if on_device else "cpu"
        empty = {e: torch.zeros(x.shape, dtype=self.dtype, device=out_device) for e, x in batches.items() if x.shape[0] == 0}
        batches = {e: x for e, x in batches.items() if x.shape[0] > 0}  # no tokens: no load, no compute
        keys, owners = [resolved[e][0] for e in batches], [resolved[e][1] for e in batches]
        pinned: list[Key] = []
        with self._lock:
            self._inflight += 1
            self._wake(keys, owners)
            # Every replica resident and none loaded ahead (most calls): pin them all at once.
            if self._ahead.isdisjoint(keys) and all(self.table.state(key) in RESIDENT for key in keys):
                for key in keys:
                    self.table.acquire(key)
                pinned = keys
                weights = [self._weights[key] for key in keys]
        cold: list[Key] = []
        compute_s: float | None = None  # set once the call has computed
        try:
            if not pinned:
                cold, weights = self._pin_all(layer, keys, pinned, owners)
            # 3. Compute outside the lock.
            for (expert, x), w in zip(batches.items(), weights):
                if x.shape[1] != w["gate"].shape[1]:
                    raise BadRequest(f"expert {expert}: tokens must be [n, H={w['gate'].shape[1]}], got {list(x.shape)}")
            clock = compute_clock(self.device)
            started = clock()
            xs = [x.to(self.device, self.dtype) for x in batches.values()]  # no copy where it is there already
            loras = [self._loras.get(self.models.resolve(layer, e)) for e in batches] if self._loras else []
            outs = (lora_forward(weights, loras, xs, self.models.act, out) if any(loras) else
                    self._forward(weights, xs, self.models.act, out))
            result = {e: y.to(out_device) for e, y in zip(batches, outs)}
            if on_device and self.device != "cpu":
                torch.cuda.synchronize(self.device)  # compute_s counts the kernels, not their launch
            result |= empty
            compute_s = clock() - started
        finally:
            with self._lock:
                if compute_s is not None:  # before the release: a use of the replica while it is held
                    self.meters.invoked(zip(keys, (int(x.shape[0]) for x in batches.values()), owners))
                for key in pinned:
                    self._dropped(self.table.release(key))
                self._inflight -= 1
        return InvokeResult(result, len(cold), compute_s)

    def _pin_all(self, layer: int, keys: list[Key], pinned: list[Key], owners: list[int]) -> tuple[list[Key], list[dict]]:
        """Start every missing load at once (each for owners[i], its model), then pin each replica (waiting
        for its load), adding each to `pinned` as it is; count the cold starts -> (the cold keys, their weights)."""
        with self._lock:
            cold = [(key, m) for key, m in zip(keys, owners) if self.table.state(key) not in RESIDENT]
            loading = {key: self._start_load(key, m, urgent=True)[0] for key, m in cold}
            for key, m in cold:
                self.meters.cold_start(key, m)
            cold = [key for key, _ in cold]
            ahead = self._ahead.intersection(keys)
            self._ahead.difference_update(keys)
        waited: dict[Key, float] = {}
        for key, m in zip(keys, owners):
            waited[key] = self._pin(key, loading.get(key), m)
            pinned.append(key)
        # Cold-start meters: what prefetching hid, what this call waited for.
        with self._lock:
            for key in set(cold) | ahead:  # a resident replica loaded ahead waited for nothing
                load_s = self.meters.replicas[key].last_load_s
                self.meters.cold.used(layer, load_s, waited[key] if key in cold else 0.0, prefetched=key in ahead)
            return cold, [self._weights[key] for key in keys]

    def set_keep_alive(self, keep_alive_s: float) -> float:
        """Idle replicas stay keep_alive_s from now on (the sweeper's next pass uses it); BadRequest below 0."""
        if not keep_alive_s >= 0:
            raise BadRequest(f"keep_alive_s must be >= 0, got {keep_alive_s}")
        with self._lock:
            self.keep_alive_s = self.table.keep_alive_s = keep_alive_s
            self.meters.set_keep_alive(keep_alive_s)
        log.info("keep-alive now %g s", keep_alive_s)
        return keep_alive_s

    def add_model(self, name: str, root: str) -> ModelRange:
        """Serve the weight store at root as model `name` from now on, without a restart (a fine-tune finds
        the experts it shares with its base resident: model_stores.py); WeightStoreError says what is wrong."""
        store = WeightStore.open(root)  # outside the lock: reads its index (and its base's)
        with self._lock:
            added = self.models.add(name, store)
            self.meters.users_changed()
            self._hold_loras()
            if self.table.shares is not None:  # no guarantee for it; its shared keys' users count it
                self.table.shares = self.models.extend(self.table.shares)
        log.info("serving model %s too (layers %d-%d)", name, added.first_layer, added.first_layer + added.layers - 1)
        return added

    def resident_weights(self, content_key: str) -> Weights | None:
        """The weights of the replica of `content_key` where it is resident here (a peer copies them), else None."""
        key = self.models.by_content(content_key)
        with self._lock:
            return self._weights.get(key) if key is not None and self.table.state(key) in RESIDENT else None

    inflight = property(lambda self: self._inflight, doc="Calls computing now (a drain waits for them).")

    def status(self) -> dict:
        """Host facts, every replica seen (state, bytes, GB·s, seconds idle, kept, counts, its models, the other
        host keys it computes: "aliases"), the host's totals, each model's part (meters.by_model), the cold-start
        meters ("cold": per layer hidden / exposed seconds), the host tier's and the peer copies' counters."""
        models, aliases = self.models, self.models.aliases()
        with self._lock:
            now, replicas = self.meters.clock(), []  # one reading: the models' GB·s add up to the host's
            kept = self.table.kept(self.calls.keeps(now, self.keep_alive_s))  # idle, held past the keep-alive
            for key, r in sorted(self.table.replicas().items()):
                m = self.meters.replicas[key]
                replicas.append({
                    "layer": key[0], "expert": key[1], "state": r.state.value, "bytes": r.bytes, "error": r.error,
                    "gb_s": self.meters.gb_s(key, now), "idle_s": self.table.idle_s(r, now), "kept": key in kept,
                    "invocations": m.invocations, "tokens": m.tokens, "last_load_s": m.last_load_s, "loads": m.loads,
                    "cold_starts": m.cold_starts, "evictions": m.evictions,
                    "models": [models.names[i] for i in models.users(key)], "aliases": aliases.get(key, [])})
            return {
                "device": self.device, "memory_bytes": self.table.capacity_bytes,
                "keep_alive_s": self.keep_alive_s, "health": self.health, "inflight": self._inflight,
                "replicas": replicas, "meters": self.meters.totals(now).as_dict(),
                "models": {name: asdict(t) for name, t in
                           self.meters.by_model(models.names, models.index_of, now).items()},
                "cold": self.meters.cold.as_dict(), "host_tier": self.tier.stats(), "peer_copies": self.peers.figures(),
            }

    def close(self) -> None:
        """Stop the sweeper and the load pool (waits for loads already running)."""
        self._stop.set()
        self._sweeper.join()
        self._pool.shutdown(wait=True, cancel_futures=True)
        self.peers.close()

    # --- internals --------------------------------------------------------------------------

    def _hold_loras(self) -> None:
        """The served models' LoRA factors not on the device yet put there, metered as each model's own."""
        new = device_loras({k: f for k, f in self.models.loras().items() if k not in self._loras}, self.device, self.dtype)
        self._loras |= new
        for i, nbytes in bytes_by_model(new, self.models.index_of).items():
            self.meters.hold_adapter(i, nbytes)

    def _start_load(self, key: Key, model: int, urgent: bool = False, source: str = "") -> tuple[Future | None, bool]:
        """Under the lock: the future of key's load, starting one (for `model`, from `source` if it is a peer's
        address: peer_copy.py) if not resident; urgent: a call's."""
        if key in self._loads:
            return self._pool.hurried(self._loads[key], urgent), False
        if not self.table.needs_load(key):
            return None, False
        self._dropped(self.table.begin_load(key, self._resident_bytes(key), model))
        self._loads[key] = future = self._pool.submit(self._load_weights, key, source, urgent=urgent)
        return future, True

    def _load_weights(self, key: Key, source: str) -> None:
        """On a load thread: key's weights from the host tier, the peer at `source` or the store (peer_copy.py's
        choice), copied to the device; record the outcome."""
        weights, error = None, None
        try:
            raw = self.peers.fetch(self.tier, key, source, self.models.content_key(key) if source else "")
            started = time.perf_counter()
            weights = self._copier.to_device(raw)
            with self._lock:
                self.meters.cold.copied(time.perf_counter() - started)
        except WeightStoreError as err:
            error = str(err)
        except Exception as err:  # a device or conversion failure is this replica's problem only
            error = f"expert (layer {key[0]}, expert {key[1]}): {type(err).__name__}: {err}"
        with self._lock:
            self.table.finish_load(key, error)
            if weights is not None:
                self._weights[key] = weights
            else:
                self._ahead.discard(key)  # a failed prefetch is not a hidden cold start
            del self._loads[key]
        if error is not None:
            log.warning("replica (layer %d, expert %d) failed to load: %s", key[0], key[1], error)
            raise ReplicaLoadError(f"layer {key[0]} expert {key[1]} failed to load: {error}")

    def _pin(self, key: Key, load: Future | None, model: int) -> float:
        """Acquire key for an invocation, waiting for `load` (its load, which raises if it failed: not retried
        here) and again if it was evicted meanwhile; returns the seconds waited (on the injected clock)."""
        started = self.meters.clock()
        if load is not None:
            load.result()
        while True:
            with self._lock:
                if self.table.state(key) in RESIDENT:
                    self.table.acquire(key)
                    return self.meters.clock() - started
                future, _ = self._start_load(key, model, urgent=True)
            future.result()

    def _dropped(self, keys: list[Key]) -> None:
        """Under the lock: keys were evicted; free their weights, count prefetches never used."""
        for key in keys:
            self._weights.pop(key, None)
            if key in self._ahead:
                self._ahead.discard(key)
                self.meters.cold.prefetch_wasted += 1

    def _resident_bytes(self, key: Key) -> int:
        """Bytes key takes in the compute dtype (the store may hold a narrower one than float32)."""
        return self.models.expert_bytes(*key) * self.dtype.itemsize // stored_dtype(self.models).itemsize

    def _wake(self, keys: list[Key], owners: list[int]) -> None:
        """Under the lock: what a call loads ahead (model_calls.py: a waking model's wake set, a fine-tune's
        base where it calls its own), into free memory only."""
        for key, m in self.calls.ahead(keys, owners, self.meters.clock(), self.keep_alive_s,
                                       lambda k: not self.table.needs_load(k)):
            room = self.table.capacity_bytes - self.table.bytes_held
            if room >= self._resident_bytes(key) and self._start_load(key, m)[1]:
                self._ahead.add(key)

    def _sweep(self) -> None:
        period = min(max(self.keep_alive_s / 4, 0.05), 1.0)
        while not self._stop.wait(period):
            with self._lock:
                self._dropped(self.table.expire(self.calls.keeps(self.meters.clock(), self.keep_alive_s)))
