"""Each model's last call on one expert host, and what the runtime loads ahead or keeps because of it:

1. **Wake-ups.** A model's first call here in a keep-alive wakes it: its wake set loads at once
   (ModelStores.wake_set: a fine-tune waking on a warm base loads its own experts where the base's
   are held, on every host, instead of layer by layer as its tokens reach them).
2. **Family warmth.** A fine-tune's base stays whole while the fine-tune calls. (a) A call of a
   fine-tune's own expert that is resident loads the base's expert at that place (the one it
   replaced: ModelStores.base_at) ahead, if not held; (b) while a fine-tune has called here within
   the keep-alive, its base's replicas outlive their own keep-alive (a family: the models sharing
   replicas, ModelStores.family; its base: ModelStores.base_of, the one whose store is over no
   other's, whose replicas the others share). Both only for a replica that a model not calling
   uses (the base itself, or a fine-tune asleep: it may wake). Without them the base's experts that
   no awake fine-tune routes to (those they replaced, and the cold ones) are not held while the
   family is awake, and the next fine-tune to wake, which uses them, loads them beside its own: in
   the twin (docs/shared-pool.md) Mixtral-8x7B fine-tunes replacing 15% woke in a p99 of 15.8% of
   a whole-model wake, 9.5% with them. A fine-tune's own replicas keep their keep-alive, and so
   does every replica while no fine-tune calls (a base alone, an unrelated model). Both only use
   free memory or stop the keep-alive's eviction: a load that needs room still evicts such a
   replica (lifecycle.py); its GB·s go by meters.py's rule to the models that used it last, or to
   the fine-tune that loaded it.
   `family_warm=False` (`expert-host --no-family-warm`) turns it off.

Not thread-safe: the runtime calls it under its lock, on its clock's times.
"""

from __future__ import annotations

from typing import Callable, Iterable, Sequence

from moeless.expert_fn.host.shares import Key
from moeless.expert_fn.stores.model_stores import ModelStores


class ModelCalls:
    """The last call of each model (an index in --store order) over `models` (model_stores.ModelStores:
    users, base_of, base_at and wake_set of its canonical replicas)."""

    def __init__(self, models: ModelStores, family_warm: bool = True) -> None:
        self.models, self.family_warm = models, family_warm
        self._last: dict[int, float] = {}

    def called(self, models: Iterable[int], now: float, keep_alive_s: float) -> list[int]:
        """Record a call of `models` at now; returns those it wakes (no call here within keep_alive_s)."""
        waking = [m for m in sorted(set(models)) if now - self._last.get(m, -float("inf")) > keep_alive_s]
        for m in set(models):
            self._last[m] = now
        return waking

    def ahead(self, keys: Sequence[Key], owners: Sequence[int], now: float, keep_alive_s: float,
              held: Callable[[Key], bool]) -> list[tuple[Key, int]]:
        """A call's replicas to load ahead, (key, for which model), in order: each model it wakes, its
        wake set; then (family warmth) the base's replica at the place of each own replica it calls that
        is held, if a model asleep uses it. keys, owners: the call's canonical replicas and their models;
        held(key): resident or loading."""
        out = [(key, m) for m in self.called(owners, now, keep_alive_s)
               for key in self.models.wake_set(m, lambda k: k in keys or held(k))]
        for key, m in zip(keys, owners) if self.family_warm else ():
            base = self.models.base_at(key)
            if base is not None and held(key) and not held(base) and self._asleep_user(base, now, keep_alive_s):
                out.append((base, m))
        return out

    def _asleep_user(self, key: Key, now: float, keep_alive_s: float) -> bool:
        """Whether a model using `key` has not called here within keep_alive_s (it may wake and need it)."""
        return any(now - self._last.get(m, -float("inf")) > keep_alive_s for m in self.models.users(key))

    def keeps(self, now: float, keep_alive_s: float) -> Callable[[Key], bool] | None:
        """Whether a replica stays past its keep-alive (its users include the base of a fine-tune that
        called within keep_alive_s, and one that did not), or None where nothing does (family warmth
        off, no fine-tune called)."""
        if not self.family_warm:
            return None
        bases = set()
        for m, t in self._last.items():
            base = self.models.base_of(m)
            if base != m and now - t <= keep_alive_s:  # a fine-tune that called within the keep-alive
                bases.add(base)
        if not bases:
            return None
        return lambda key: not bases.isdisjoint(self.models.users(key)) and self._asleep_user(key, now, keep_alive_s)
