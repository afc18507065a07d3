"""Meters of one expert host: memory held over time (GB·s), loads, cold starts, invocations,
and per MoE layer the cold-start time prefetching hid and the time invocations waited (exposed).

GB·s integrates the bytes each replica holds, from the start of its load to its eviction
(the `resident` billing model of docs/design.md), with GB = 1e9 bytes. Pure bookkeeping on an
injected clock; metrics.py exposes it, the Status RPC reports it.

Several models on one host (expert_fn/stores/model_stores.py) may share a replica (one per content
key). Its GB·s is split among them by this rule (docs/shared-pool.md says why): at each moment, evenly
among the models that used it within the keep-alive before that moment (the models whose use
keeps it resident); a moment no model's use covers (loaded ahead and not used yet, kept past the
keep-alive as a keep-warm replica) goes to the model(s) that used it last in this residency, or to
the model that loaded it. Each model's part is settled lazily (`_settle`, at every use, eviction
and read) and does not depend on when it is read; the parts add up to the replica's GB·s, so the
models' figures add up to the host's. A replica of one model is all that model's.

Cold starts: a load started ahead of the invocation that needs it (a prefetch: `load` without
wait) hides its time, except what the invocation still waits for; a load the invocation starts
itself is all exposed. Only the exposed part costs latency.

A LoRA fine-tune's factors (expert_fn/host/adapters.py) are its own memory, held while the host
serves it (`hold_adapter`): all of their GB·s and bytes are that model's, and the host's totals
include them.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable, Iterable, Sequence

Key = tuple[int, int]  # (layer, expert)
GB = 1e9


@dataclass
class ReplicaMeters:
    bytes: int = 0  # held now
    byte_seconds: float = 0.0  # closed intervals only; see Meters.gb_s
    held_since: float = 0.0
    loads: int = 0
    load_failures: int = 0
    last_load_s: float = 0.0
    cold_starts: int = 0
    evictions: int = 0
    invocations: int = 0
    tokens: int = 0
    # Per model (index): the GB·s split (byte-seconds, settled up to `settled`), loads, cold starts, tokens.
    loader: int = 0  # the model whose call loaded the current residency
    used: dict[int, float] = field(default_factory=dict)  # model -> its last use in this residency
    settled: float = 0.0
    split: dict[int, float] = field(default_factory=dict)
    shared: bool = False  # other models' stores hold its key too (now: Meters.users_changed)
    shared_split: dict[int, float] = field(default_factory=dict)  # the part of split settled while shared
    loads_by: dict[int, int] = field(default_factory=dict)
    cold_by: dict[int, int] = field(default_factory=dict)
    tokens_by: dict[int, int] = field(default_factory=dict)


def _bump(counts: dict[int, int], model: int, n: int = 1) -> None:
    counts[model] = counts.get(model, 0) + n


@dataclass
class HostTotals:
    gb_s: float = 0.0
    bytes_held: int = 0
    loads: int = 0
    load_failures: int = 0
    load_s_sum: float = 0.0
    cold_starts: int = 0
    evictions: int = 0
    invocations: int = 0  # Invoke calls (one per layer per call), not per expert
    tokens: int = 0
    # Cold starts over all layers (ColdMeters): seconds prefetching hid, seconds invocations waited.
    cold_hidden_s: float = 0.0
    cold_exposed_s: float = 0.0
    cold_waits: int = 0
    prefetched: int = 0
    prefetch_wasted: int = 0
    shared_replicas: int = 0  # resident replicas that more than one model uses
    lora_bytes: int = 0  # LoRA fine-tunes' factors (in bytes_held too)

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ModelTotals:
    """One model's part of a host's totals (a host serving several models: model_stores.py). gb_s and
    bytes_held are its split of shared replicas (module docstring), so every model's add up to the
    host's; shared_gb_s the part of gb_s held while other models of the host held the replica's
    content key too (a model added later shares from then on); own_replicas, shared_replicas and
    shared_bytes: the resident replicas it uses alone or with other models (a shared one counted
    for each)."""

    gb_s: float = 0.0
    shared_gb_s: float = 0.0
    bytes_held: int = 0
    loads: int = 0
    cold_starts: int = 0
    tokens: int = 0
    cold_hidden_s: float = 0.0
    cold_exposed_s: float = 0.0
    own_replicas: int = 0
    shared_replicas: int = 0
    shared_bytes: int = 0
    lora_bytes: int = 0  # its LoRA factors, its own (in bytes_held and gb_s too)


@dataclass
class LayerColdMeters:
    """Cold starts of one MoE layer on this host: seconds hidden by prefetch and exposed (waited)."""

    hidden_s: float = 0.0
    exposed_s: float = 0.0
    waits: int = 0  # replica loads an invocation waited for
    prefetched: int = 0  # replica loads started ahead that an invocation then used


@dataclass
class ColdMeters:
    """Per-layer cold-start meters, prefetches never used (evicted first), and device copies."""

    layers: dict[int, LayerColdMeters] = field(default_factory=dict)
    prefetch_wasted: int = 0
    copies: int = 0  # host tier -> device copies (cold starts proper)
    copy_s_sum: float = 0.0

    def used(self, layer: int, load_s: float, waited_s: float, prefetched: bool) -> None:
        """An invocation of `layer` used a replica loaded for it: load_s its load's duration,
        waited_s how long the invocation waited for it (0 when resident by then)."""
        m = self.layers.setdefault(layer, LayerColdMeters())
        m.exposed_s += waited_s
        if waited_s > 0 or not prefetched:
            m.waits += 1
        if prefetched:
            m.prefetched += 1
            m.hidden_s += max(load_s - waited_s, 0.0)

    def copied(self, copy_s: float) -> None:
        """A replica's weights went from the host tier to the device in copy_s seconds."""
        self.copies += 1
        self.copy_s_sum += copy_s

    def as_dict(self) -> dict:
        return {"layers": {l: asdict(m) for l, m in sorted(self.layers.items())}, "prefetch_wasted": self.prefetch_wasted,
                "copies": self.copies, "copy_s_sum": self.copy_s_sum}


@dataclass
class Meters:
    """Counters per replica and per host. Not thread-safe: used under the runtime's lock. Models are
    indices (model_stores.py's order); keep_alive_s: the window of a model's claim on a shared replica."""

    clock: Callable[[], float]
    keep_alive_s: float = 60.0
    replicas: dict[Key, ReplicaMeters] = field(default_factory=dict)
    host_invocations: int = 0
    load_s_sum: float = 0.0
    cold: ColdMeters = field(default_factory=ColdMeters)
    adapters: dict[int, tuple[int, float]] = field(default_factory=dict)  # model -> (LoRA bytes, held since)
    users: Callable[[Key], Sequence[int]] = lambda key: ()  # the models whose stores hold key (now)

    def hold_adapter(self, model: int, nbytes: int) -> None:
        """`model`'s LoRA factors hold nbytes from now on (while the host serves it)."""
        self.adapters[model] = (nbytes, self.clock())

    def _adapter_gb_s(self, now: float) -> dict[int, float]:
        return {i: nbytes * (now - since) / GB for i, (nbytes, since) in self.adapters.items()}

    def _of(self, key: Key) -> ReplicaMeters:
        return self.replicas.setdefault(key, ReplicaMeters())

    def hold(self, key: Key, nbytes: int, model: int = 0) -> None:
        """key starts holding nbytes (a load began, for `model`)."""
        m = self._of(key)
        self.free(key)
        now = self.clock()
        m.bytes, m.held_since, m.settled, m.loader, m.used = nbytes, now, now, model, {}
        m.shared = len(self.users(key)) > 1

    def users_changed(self) -> None:
        """The models whose stores hold each key changed (a model added): what was held until now
        was shared or a model's own as it was then; from now on as it is."""
        now = self.clock()
        for key, m in self.replicas.items():
            self._settle(m, now)
            m.shared = len(self.users(key)) > 1

    def free(self, key: Key) -> None:
        """key stops holding memory (evicted or its load failed)."""
        m = self._of(key)
        if m.bytes:
            now = self.clock()
            self._settle(m, now)
            m.byte_seconds += m.bytes * (now - m.held_since)
            m.bytes, m.used = 0, {}

    def set_keep_alive(self, keep_alive_s: float) -> None:
        """A new claim window from now on (what is held so far is split under the old one)."""
        now = self.clock()
        for m in self.replicas.values():
            self._settle(m, now)
        self.keep_alive_s = keep_alive_s

    def loaded(self, key: Key, seconds: float, ok: bool) -> None:
        m = self._of(key)
        m.loads += 1
        m.load_failures += 0 if ok else 1
        m.last_load_s = seconds
        self.load_s_sum += seconds
        _bump(m.loads_by, m.loader)

    def cold_start(self, key: Key, model: int = 0) -> None:
        """An invocation of key by `model` had to wait for a load."""
        m = self._of(key)
        m.cold_starts += 1
        _bump(m.cold_by, model)

    def evicted(self, key: Key) -> None:
        self._of(key).evictions += 1

    def invoked(self, uses: Iterable[tuple[Key, int, int]]) -> None:
        """One Invoke call: (replica, its tokens, the model they are of) per expert (two experts of a call may
        be one replica; a call may carry several models' tokens: model_stores.resolve)."""
        self.host_invocations += 1
        now = self.clock()
        for key, n, model in uses:
            m = self._of(key)
            m.invocations += 1
            m.tokens += n
            _bump(m.tokens_by, model, n)
            self._settle(m, now)
            if m.bytes:
                m.used[model] = now

    def needed_by(self, key: Key) -> list[int]:
        """The models that used key within the keep-alive (its memory is held for them now)."""
        now, m = self.clock(), self._of(key)
        return sorted(i for i, used in m.used.items() if used + self.keep_alive_s > now) if m.bytes else []

    def gb_s(self, key: Key, now: float | None = None) -> float:
        """GB·s held by key so far, including the interval still open (until now, default the clock)."""
        m = self._of(key)
        open_part = m.bytes * ((self.clock() if now is None else now) - m.held_since) if m.bytes else 0.0
        return (m.byte_seconds + open_part) / GB

    def by_model(self, names: Sequence[str], model_of: Callable[[int], int],
                 now: float | None = None) -> dict[str, ModelTotals]:
        """Totals per model name (names[i]: model i; model_of(layer): the model of a host layer, for
        the cold-start seconds of its calls; own and shared replicas by self.users); GB·s and bytes
        held add up to totals(now)."""
        now = self.clock() if now is None else now
        out = {name: ModelTotals() for name in names}
        for key, m in self.replicas.items():
            self._settle(m, now)
            sharing = self.users(key)
            for i, byte_s in m.split.items():
                out[names[i]].gb_s += byte_s / GB
            for i, byte_s in m.shared_split.items():
                out[names[i]].shared_gb_s += byte_s / GB
            payers = self._payers(m, now) if m.bytes else []
            for n, i in enumerate(payers):  # whole bytes, the remainder to the first: they add up exactly
                out[names[i]].bytes_held += m.bytes // len(payers) + (m.bytes % len(payers) if n == 0 else 0)
            for counts, attr in ((m.loads_by, "loads"), (m.cold_by, "cold_starts"), (m.tokens_by, "tokens")):
                for i, n in counts.items():
                    setattr(out[names[i]], attr, getattr(out[names[i]], attr) + n)
            if m.bytes:
                for i in sharing or (model_of(key[0]),):
                    t = out[names[i]]
                    if len(sharing) > 1:
                        t.shared_replicas += 1
                        t.shared_bytes += m.bytes
                    else:
                        t.own_replicas += 1
        for i, gb_s in self._adapter_gb_s(now).items():
            t = out[names[i]]
            t.gb_s += gb_s
            t.bytes_held += self.adapters[i][0]
            t.lora_bytes += self.adapters[i][0]
        for layer, c in self.cold.layers.items():
            t = out[names[model_of(layer)]]
            t.cold_hidden_s += c.hidden_s
            t.cold_exposed_s += c.exposed_s
        return out

    def totals(self, now: float | None = None) -> HostTotals:
        now = self.clock() if now is None else now
        layers = self.cold.layers.values()
        t = HostTotals(invocations=self.host_invocations, load_s_sum=self.load_s_sum,
                       cold_hidden_s=sum(m.hidden_s for m in layers), cold_exposed_s=sum(m.exposed_s for m in layers),
                       cold_waits=sum(m.waits for m in layers), prefetched=sum(m.prefetched for m in layers),
                       prefetch_wasted=self.cold.prefetch_wasted)
        for key, m in self.replicas.items():
            t.gb_s += self.gb_s(key, now)
            t.bytes_held += m.bytes
            t.loads += m.loads
            t.load_failures += m.load_failures
            t.cold_starts += m.cold_starts
            t.evictions += m.evictions
            t.tokens += m.tokens
            t.shared_replicas += bool(m.bytes) and len(self.users(key)) > 1
        t.gb_s += sum(self._adapter_gb_s(now).values())
        t.lora_bytes = sum(nbytes for nbytes, _ in self.adapters.values())
        t.bytes_held += t.lora_bytes
        return t

    def _payers(self, m: ReplicaMeters, t: float) -> list[int]:
        """Who pays for m's memory at time t: the models whose last use is within the keep-alive before
        t, else those that used it last in this residency, else its loader."""
        claim = sorted(i for i, used in m.used.items() if used + self.keep_alive_s > t)
        if claim or not m.used:
            return claim or [m.loader]
        last = max(m.used.values())
        return sorted(i for i, used in m.used.items() if used == last)

    def _settle(self, m: ReplicaMeters, now: float) -> None:
        """Split m's open residency up to now among its payers, piece by piece: the payers change
        only where a model's claim runs out (uses are settled as they happen)."""
        t = m.settled
        while m.bytes and t < now:
            ends = [used + self.keep_alive_s for used in m.used.values() if used + self.keep_alive_s > t]
            until = min(ends + [now])
            payers = self._payers(m, t)
            for i in payers:
                m.split[i] = m.split.get(i, 0.0) + m.bytes * (until - t) / len(payers)
                if m.shared:
                    m.shared_split[i] = m.shared_split.get(i, 0.0) + m.bytes * (until - t) / len(payers)
            t = until
        m.settled = max(m.settled, now)
