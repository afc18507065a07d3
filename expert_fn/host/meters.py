"""Meters of one expert host: memory held over time (GB·s), loads, cold starts, invocations,
and per MoE layer the cold-start time prefetching hid and the time invocations waited (exposed).

GB·s integrates the bytes each replica holds, from the start of its load to its eviction
(the `resident` billing model of docs/design.md), with GB = 1e9 bytes. Pure bookkeeping on an
injected clock; metrics.py exposes it, the Status RPC reports it.

Cold starts: a load started ahead of the invocation that needs it (a prefetch: `load` without
wait) hides its time, except what the invocation still waits for; a load the invocation starts
itself is all exposed. Only the exposed part costs latency.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Callable

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

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class ModelTotals:
    """One model's part of a host's totals (a host serving several models: model_stores.py)."""

    gb_s: float = 0.0
    bytes_held: int = 0
    loads: int = 0
    cold_starts: int = 0
    tokens: int = 0
    cold_hidden_s: float = 0.0
    cold_exposed_s: float = 0.0


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

    def as_dict(self) -> dict:
        return {"layers": {l: asdict(m) for l, m in sorted(self.layers.items())}, "prefetch_wasted": self.prefetch_wasted,
                "copies": self.copies, "copy_s_sum": self.copy_s_sum}


@dataclass
class Meters:
    """Counters per replica and per host. Not thread-safe: used under the runtime's lock."""

    clock: Callable[[], float]
    replicas: dict[Key, ReplicaMeters] = field(default_factory=dict)
    host_invocations: int = 0
    load_s_sum: float = 0.0
    cold: ColdMeters = field(default_factory=ColdMeters)

    def _of(self, key: Key) -> ReplicaMeters:
        return self.replicas.setdefault(key, ReplicaMeters())

    def hold(self, key: Key, nbytes: int) -> None:
        """key starts holding nbytes (a load began)."""
        m = self._of(key)
        self.free(key)
        m.bytes, m.held_since = nbytes, self.clock()

    def free(self, key: Key) -> None:
        """key stops holding memory (evicted or its load failed)."""
        m = self._of(key)
        if m.bytes:
            m.byte_seconds += m.bytes * (self.clock() - m.held_since)
            m.bytes = 0

    def loaded(self, key: Key, seconds: float, ok: bool) -> None:
        m = self._of(key)
        m.loads += 1
        m.load_failures += 0 if ok else 1
        m.last_load_s = seconds
        self.load_s_sum += seconds

    def cold_start(self, key: Key) -> None:
        """An invocation of key had to wait for a load."""
        self._of(key).cold_starts += 1

    def evicted(self, key: Key) -> None:
        self._of(key).evictions += 1

    def invoked(self, layer: int, tokens: dict[int, int]) -> None:
        """One Invoke call on layer with tokens[expert] tokens per expert."""
        self.host_invocations += 1
        for expert, n in tokens.items():
            m = self._of((layer, expert))
            m.invocations += 1
            m.tokens += n

    def gb_s(self, key: Key, now: float | None = None) -> float:
        """GB·s held by key so far, including the interval still open (until now, default the clock)."""
        m = self._of(key)
        open_part = m.bytes * ((self.clock() if now is None else now) - m.held_since) if m.bytes else 0.0
        return (m.byte_seconds + open_part) / GB

    def by_model(self, model_of: Callable[[int], str], now: float | None = None) -> dict[str, ModelTotals]:
        """Totals per model, model_of(layer) naming the model of a host layer; they add up to totals(now)."""
        now = self.clock() if now is None else now
        out: dict[str, ModelTotals] = {}
        for key, m in self.replicas.items():
            t = out.setdefault(model_of(key[0]), ModelTotals())
            t.gb_s += self.gb_s(key, now)
            t.bytes_held += m.bytes
            t.loads += m.loads
            t.cold_starts += m.cold_starts
            t.tokens += m.tokens
        for layer, c in self.cold.layers.items():
            t = out.setdefault(model_of(layer), ModelTotals())
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
        return t
