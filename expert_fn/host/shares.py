"""Who yields memory on a host shared by models: guaranteed shares, then the replicas that save the
least per GB·s; and what a model keeps warm past the keep-alive.

Each model on the host (model_stores.py: a range of its layers) may have a guaranteed share of the
host's bytes: what its static replicas need while it is active. A load that needs room evicts idle
replicas in this order:

1. replicas of models holding more than their share, or of models not active (no replica used
   within `active_s`: a sleeping model keeps no guarantee), the least saving per GB·s first,
   whichever model owns them;
2. then the loading model's own replicas, the least saving per GB·s first;
never an active model's replica that its share still covers for another model's load: no model can
take another's guaranteed share. As victims go, a model's held bytes fall; once they reach its
share, its remaining replicas are protected from the others.

Shared replicas (one per content key, model_stores.py): a replica that several models use counts
in each one's held bytes and is protected by each one's share, so no model's load evicts what
another active model's share still covers, whichever model's layers it was filed under; it is the
loading model's own when the loading model uses it. A model is active while any replica it uses
was used by it within `active_s` (`Candidate.used_by`: each model's last use).

Keep-warm (`warm_set`): a model may keep its hottest replicas (most tokens computed), up to its
warm bytes, resident past the keep-alive, so that it wakes with them when it has been quiet; they
are not guaranteed (a load that needs room evicts them like any idle replica).

A replica's saving per GB·s (`saving_per_gb_s`): what keeping it resident saves per second, the
reload it avoids (`reload_s`: the replica table prices it at its model's measured load seconds per
byte, so a model whose store is slower keeps its replicas longer) times how often it is used, per
GB it holds. Its use rate is estimated from its idle time,
1 / idle seconds, the estimate least recently used eviction makes: with every reload costing the
same per byte the order is LRU's. A decayed call count, measured instead on real routing, needs a
horizon tuned to the host's memory and costs 16-32% more cold starts when it is 10x off
(docs/shared-pool/notes.md); the idle time needs none.

Pure: the replica table (lifecycle.py) calls `pick_victims` and `warm_set` under the runtime's lock. Shares of 0
(the default) give plain least-recently-used eviction, as before shares existed.

Tiny example (the golden test): models A (layers 0-1) and B (layers 2-3), each guaranteed 2 bytes,
replicas of 1 byte: A holds (0,0) used at t=1 and (1,0) at t=2, B holds (2,0) at t=3, (3,0) at t=4
and (2,1) at t=5, all idle, on a host of 5 bytes. A load of A's (0, 1) needing 1 byte evicts B's
(2,0) (B is over its share, and it is the least recently used there), not A's older (0,0). With
load times the cheaper reload goes first: if (0,0) took 4 s to load and (1,0) 1 s, then at t=6
(0,0) saves 4 s / 5 s idle = 0.8 s per byte-second and (1,0) 1 s / 4 s = 0.25, so A's own
(1,0) yields before (0,0), though used more recently.
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass, field
from typing import Mapping, Sequence

Key = tuple[int, int]  # (host layer, expert)


@dataclass(frozen=True)
class Shares:
    """first_layers: each model's first host layer, ascending (model i owns layers first_layers[i]
    up to the next one's); guaranteed: each model's guaranteed bytes while active; active_s: a
    model with no replica used for this long is asleep (no guarantee)."""

    first_layers: tuple[int, ...]
    guaranteed: tuple[int, ...]
    active_s: float
    warm: tuple[int, ...] = ()  # bytes of each model's hottest replicas kept past the keep-alive (empty: none)
    users: Mapping[Key, tuple[int, ...]] = field(default_factory=dict)  # shared replicas' models (2 or more)

    def model_of(self, layer: int) -> int:
        return max(bisect_right(self.first_layers, layer) - 1, 0)

    def models_of(self, key: Key) -> tuple[int, ...]:
        """Every model that uses replica key (its layer's model, or the models sharing it)."""
        return self.users.get(key) or (self.model_of(key[0]),)


@dataclass(frozen=True)
class Candidate:
    """A replica the table could evict: key, bytes, idle (evictable now), last_used; reload_s: what
    loading it again would take (0: not known)."""

    key: Key
    bytes: int
    idle: bool
    last_used: float
    reload_s: float = 0.0
    used_by: tuple[tuple[int, float], ...] = ()  # (model, its last use) of a shared replica; empty: last_used


def saving_per_gb_s(r: Candidate, now: float) -> float:
    """Seconds of reload that keeping r resident saves per GB·s it holds: reload_s x (1 / idle s) / GB."""
    return r.reload_s / max(r.bytes / 1e9, 1e-12) / max(now - r.last_used, 1e-6)


def pick_victims(replicas: Sequence[Candidate], shares: Shares, requester: Key, free: int, need: int,
                 now: float, mine: int | None = None) -> list[Key] | None:
    """The idle replicas to evict so that `need` bytes fit (free: bytes free now), in the module
    docstring's order; None when they cannot be found without taking a share. mine: the loading
    model (default: the model of the requester's layer)."""
    # 1. Each model's held bytes and whether it is active (any replica it uses, idle or busy, counts).
    models = len(shares.first_layers)
    held, active = [0] * models, [False] * models
    for r in replicas:
        for m, used in r.used_by or ((u, r.last_used) for u in shares.models_of(r.key)):
            active[m] |= not r.idle or now - used < shares.active_s
        for m in shares.models_of(r.key):
            held[m] += r.bytes
    mine = shares.model_of(requester[0]) if mine is None else mine
    # 2. Idle candidates: the requester's own replicas after everyone else's, the least saving per
    #    GB·s first within (then the least recently used: ties, and loads that took no measurable time).
    order = sorted((r for r in replicas if r.idle),
                   key=lambda r: (mine in shares.models_of(r.key), saving_per_gb_s(r, now), r.last_used))
    victims: list[Key] = []
    for r in order:
        if free >= need:
            break
        users = shares.models_of(r.key)
        if any(m != mine and active[m] and held[m] - r.bytes < shares.guaranteed[m] for m in users):
            continue  # within another active model's share
        victims.append(r.key)
        for m in users:
            held[m] -= r.bytes
        free += r.bytes
    return victims if free >= need else None


def warm_set(held: Sequence[tuple[Key, int, int]], shares: Shares) -> set[Key]:
    """The replicas the keep-alive leaves resident: held is (key, bytes, tokens) of every replica
    holding memory; per model, its hottest (most tokens, then key) while their bytes add up to at
    most its warm bytes (a replica that does not fit is skipped, a smaller hot one may follow)."""
    if not any(shares.warm):
        return set()
    left = list(shares.warm)
    keep: set[Key] = set()
    for key, nbytes, _ in sorted(held, key=lambda h: (-h[2], h[0])):
        m = shares.model_of(key[0])
        if m < len(left) and nbytes <= left[m]:
            keep.add(key)
            left[m] -= nbytes
    return keep
