"""Several models' weight stores behind one host: one layer space, so replicas of every model share
the host's memory, its keep-alive and its eviction order.

Model i's layer l is the host's layer first_i + l (its layers follow the previous model's), and
its experts are 0..E_i - 1. A client bound to a model (client.ExpertHostClient(model=...)) learns
its range from the host's offer and adds first_i to every layer it sends, so the runtime, the
replica table, the tiers, the meters and every transport see one model with many layers. One host
serving one store is the case first_0 = 0.

    stores = ModelStores.open([("mixtral", "/models/a"), ("phi", "/models/b")])
    stores.ranges()          # [ModelRange("mixtral", 0, 32, 8), ModelRange("phi", 32, 32, 16)]
    stores.load(33, 5)       # phi's layer 1, expert 5

All stores must use one activation and one weight dtype (the runtime computes each call with its
store's activation); opening others is an error that names them.

Experts addressed by content: every (host layer, expert) whose content key (model/content_keys.py)
another one has too maps to ONE canonical replica, the first in host-layer order (the base's, when
the base is listed before its fine-tunes). The runtime canonicalises every key it is given
(`canonical`), so the replica table, the host tier, cold starts, keep-alive, eviction and the
meters work per content key, whichever models use it: a base and fine-tunes that changed 15% of
its experts hold 1.15x the base's replicas, not 2x. Why here and not in the clients: the wire
stays as it is (a client still sends its model's own layers), the host alone knows which of its
models share which bytes, and it bills each model for its use (meters.py's split). `users(key)`
says which models a canonical replica serves: the guaranteed shares protect a shared replica for
each of them (shares.py).

    stores = ModelStores.open([("base", "/models/base"), ("code", "/models/code")])   # code over base
    stores.canonical(32 + 3, 5)   # (3, 5): code's layer 3 expert 5 is the base's bytes
    stores.users((3, 5))          # (0, 1): both models use it

A LoRA fine-tune's store (model/lora_store.py) names every expert by its base's key and carries
factors for the experts its adapter touches: read (each file verified) when the model is added, they
are that model's own memory, and `loras()` gives them by host key (resolve: a call's), which the runtime
applies over the shared replica at call time (expert_fn/host/adapters.py).
"""

from __future__ import annotations

from bisect import bisect_right
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Iterator, Sequence

import torch

from moeless.expert_fn.errors import BadRequest
from moeless.expert_fn.host.shares import Key, Shares
from moeless.model.weight_store import WeightStore, WeightStoreError


@dataclass(frozen=True)
class ModelRange:
    """A model's place in the host's layer space."""

    name: str
    first_layer: int
    layers: int
    experts: int


class ModelStores:
    """The stores of (name, WeightStore) pairs, in order, as one store of the host's layers."""

    def __init__(self, stores: Sequence[tuple[str, WeightStore]]):
        if not stores:
            raise WeightStoreError("an expert host needs at least one weight store (--store)")
        first = stores[0][1]
        self.root: Path = first.root
        self.index = {"dtype": first.index.get("dtype") or "float32"}  # what the runtime reads of an index
        self.act = first.act
        self.stores: list[WeightStore] = []
        self._ranges: list[ModelRange] = []
        self._firsts: list[int] = []
        self._canonical: dict[Key, Key] = {}  # host key -> its canonical replica, where they differ
        self._users: dict[Key, tuple[int, ...]] = {}  # canonical key -> the models using it, where several
        self._seen: dict[str, Key] = {}  # content key -> its canonical replica
        self._loras: dict[Key, dict[str, torch.Tensor]] = {}  # host key -> its model's LoRA factors
        self._families: dict[int, frozenset[int]] = {}  # model -> its family (`family`), made on demand
        self._bases_at: dict[Key, Key] | None = None  # a fine-tune's own replica -> the base's there (`base_at`)
        for name, store in stores:
            self.add(name, store)

    def add(self, name: str, store: WeightStore) -> ModelRange:
        """Put a model's store after the last one (also while the host serves: nothing else moves, and
        its experts that other models have are theirs from the start); WeightStoreError, naming them,
        for a name already served or another activation or weight dtype."""
        if name in self.names:
            raise WeightStoreError(f"model names must differ: this host serves {name!r} already; name them with "
                                   "--store NAME=DIR")
        for what, mine, hosts in (("activation", store.act, self.act),
                                  ("weight dtype", store.index.get("dtype") or "float32", self.index["dtype"])):
            if mine != hosts:
                raise WeightStoreError(f"model {name} uses {what} {mine}, this host's models {hosts}; one host serves "
                                       f"models of one {what}")
        loras = store.loras()  # first: a corrupt factor file refuses the model before anything changes
        i, first = len(self._ranges), self.num_layers if self._ranges else 0
        self._loras |= {(first + layer, expert): lora for (layer, expert), lora in loras.items()}
        for layer, expert in store.keys():
            host_key = (first + layer, expert)
            canonical = self._seen.setdefault(store.key(layer, expert), host_key)
            if canonical != host_key:
                self._canonical[host_key] = canonical
                users = self._users.get(canonical) or (self._which(canonical[0]) if canonical[0] < first else i,)
                self._users[canonical] = users if i in users else (*users, i)
        self._families.clear()
        self._bases_at = None
        self.stores.append(store)
        self._firsts.append(first)
        self._ranges.append(ModelRange(name, first, store.num_layers, store.num_experts))  # last: now it is served
        return self._ranges[-1]

    @staticmethod
    def open(stores: Sequence[tuple[str | None, str | Path]]) -> "ModelStores":
        """(name or None: the store's own model name, directory) pairs, opened in order."""
        opened = [WeightStore.open(root) for _, root in stores]
        return ModelStores([(name or str(s.index.get("model") or Path(s.root).name), s)
                            for (name, _), s in zip(stores, opened)])

    def ranges(self) -> list[ModelRange]:
        return list(self._ranges)

    @property
    def num_layers(self) -> int:
        last = self._ranges[-1]
        return last.first_layer + last.layers

    @property
    def num_experts(self) -> int:
        return max(r.experts for r in self._ranges)

    def has(self, layer: int, expert: int) -> bool:
        """Whether host key (layer, expert) addresses an expert: its model's own, or another's (`resolve`)."""
        if not 0 <= layer < self.num_layers or expert < 0:
            return False
        r = self._ranges[self._which(layer)]
        if expert < r.experts:
            return True
        j = expert // r.experts - 1
        return j < len(self._ranges) and (self._ranges[j].layers, self._ranges[j].experts) == (r.layers, r.experts)

    def resolve(self, layer: int, expert: int) -> Key:
        """The host key that (layer, expert) addresses (`has` true). Family addressing: expert ids past the
        layer's model's E name the same layer of another model of its geometry, id (j + 1) x E + e being
        model j's expert e (j in --store order), so that one routed call carries the tokens of a base and
        of its fine-tunes, each computed by its own model's expert (serving/family.py)."""
        r = self._ranges[self._which(layer)]
        if expert < r.experts:
            return layer, expert
        j, e = divmod(expert, r.experts)
        return self._ranges[j - 1].first_layer + layer - r.first_layer, e

    def check(self, layer: int, expert: int) -> tuple[Key, int]:
        """(The canonical replica, the model) of host key (layer, expert), its model's own expert or, by
        family addressing (`resolve`), another's; BadRequest for a key no store has."""
        if not self.has(layer, expert):
            raise BadRequest(f"no expert (layer {layer}, expert {expert}): the store has {self.num_layers} "
                             f"layers x {self.num_experts} experts")
        resolved = self.resolve(layer, expert)
        return self.canonical(*resolved), self.index_of(resolved[0])

    def wake_set(self, model: int, held: Callable[[Key], bool]) -> list[Key]:
        """The replicas of model's experts not held here (held(key): resident or loading) at the places
        (layer, expert) where this host holds another model's expert of the same geometry, in layer
        order: where a family engine sends this model's tokens (serving/family.py places each member's
        expert where the base's is), so what a fine-tune waking on a warm base will call here."""
        r = self._ranges[model]
        others = [o.first_layer for j, o in enumerate(self._ranges)
                  if j != model and (o.layers, o.experts) == (r.layers, r.experts)]
        out: dict[Key, None] = {}
        for layer in range(r.layers):
            for expert in range(r.experts):
                key = self.canonical(r.first_layer + layer, expert)
                if not held(key) and any(held(self.canonical(first + layer, expert)) for first in others):
                    out[key] = None
        return list(out)

    def loras(self) -> dict[Key, dict[str, torch.Tensor]]:
        """Every host key's LoRA factors (each LoRA fine-tune's own memory on the host)."""
        return dict(self._loras)

    def keys(self) -> Iterator[Key]:
        """Every distinct expert once: the canonical (host layer, expert) of each content key."""
        for r in self._ranges:
            for layer in range(r.first_layer, r.first_layer + r.layers):
                for expert in range(r.experts):
                    if (layer, expert) not in self._canonical:
                        yield layer, expert

    def canonical(self, layer: int, expert: int) -> Key:
        """The replica that computes host key (layer, expert): itself, or the first with its content key."""
        return self._canonical.get((layer, expert), (layer, expert))

    def content_key(self, key: Key) -> str:
        """Host key `key`'s content key (model/content_keys.py), as its model's store records it."""
        i = self.index_of(key[0])
        return self.stores[i].key(key[0] - self._firsts[i], key[1])

    def by_content(self, content_key: str) -> Key | None:
        """The canonical replica of `content_key`, None where no served model has that expert."""
        return self._seen.get(content_key)

    def users(self, key: Key) -> tuple[int, ...]:
        """The models (indices, in --store order) whose experts canonical replica `key` is."""
        return self._users.get(key) or (self._which(key[0]),)

    def family(self, model: int) -> frozenset[int]:
        """The models sharing a canonical replica with `model` (a base and its fine-tunes), itself included."""
        if model not in self._families:  # made once per model list (add clears them)
            self._families[model] = frozenset({model}.union(*(u for u in self._users.values() if model in u)))
        return self._families[model]

    def base_of(self, model: int) -> int:
        """The base of `model`'s family (`model` itself where it is no fine-tune): the first member in
        --store order whose store is written over no other (a fine-tune's store names its base:
        model/weight_store.py's "base"), so a fine-tune listed before its base does not become it;
        the first member where every store of the family is over another, or none is."""
        family = sorted(self.family(model))
        return next((m for m in family if "base" not in self.stores[m].index), family[0])

    def base_at(self, key: Key) -> Key | None:
        """The base's replica at the place (layer, expert) of a fine-tune's own replica `key` (canonical:
        the expert it replaced), or None where key is no fine-tune's own (a base's, a shared one). A
        dict lookup (the runtime asks at every call), made once per model list."""
        if self._bases_at is None:
            self._bases_at = {}
            for model, mine in enumerate(self._ranges):
                base = self.base_of(model)
                theirs = self._ranges[base]
                if base == model or (mine.layers, mine.experts) != (theirs.layers, theirs.experts):
                    continue
                for layer in range(mine.layers):
                    for expert in range(mine.experts):
                        own = (mine.first_layer + layer, expert)
                        if own not in self._canonical and own not in self._users:  # its own bytes, its alone
                            self._bases_at[own] = self.canonical(theirs.first_layer + layer, expert)
        return self._bases_at.get(key)

    def shared(self) -> dict[Key, tuple[int, ...]]:
        """Every canonical replica that several models use, with their indices."""
        return {key: users for key, users in self._users.items() if len(users) > 1}

    def aliases(self) -> dict[Key, list[Key]]:
        """Canonical replica -> the other host keys it computes (each model's own layer numbers)."""
        out: dict[Key, list[Key]] = {}
        for key, canonical in self._canonical.items():
            out.setdefault(canonical, []).append(key)
        return out

    def index_of(self, layer: int) -> int:
        """The index (in --store order) of the model whose layers include host layer `layer`."""
        return self._which(layer)

    @property
    def names(self) -> list[str]:
        return [r.name for r in self._ranges]

    def expert_bytes(self, layer: int, expert: int) -> int:
        store, local = self._local(layer)
        return store.expert_bytes(local, expert)

    def load(self, layer: int, expert: int, verify: bool = True) -> dict[str, torch.Tensor]:
        store, local = self._local(layer)
        return store.load(local, expert, verify=verify)

    def shares(self, guaranteed_gb: dict[str, float], capacity_bytes: int, active_s: float,
               warm_gb: dict[str, float] | None = None) -> Shares:
        """The models' guaranteed shares and keep-warm sets (shares.py) from GB per model name;
        WeightStoreError names a model this host does not serve, or GB that exceed the host's memory."""
        warm_gb = warm_gb or {}
        for flag, given in (("--share", guaranteed_gb), ("--keep-warm", warm_gb)):
            unknown = sorted(set(given) - {r.name for r in self._ranges})
            if unknown:
                raise WeightStoreError(f"{flag} {unknown[0]}: this host serves no such model; it serves {self.describe()}")
        guaranteed = tuple(int(guaranteed_gb.get(r.name, 0.0) * 1e9) for r in self._ranges)
        warm = tuple(int(warm_gb.get(r.name, 0.0) * 1e9) for r in self._ranges)
        for flag, gb in (("--share: the shares add", guaranteed), ("--keep-warm: the keep-warm sets add", warm)):
            if sum(gb) > capacity_bytes:
                raise WeightStoreError(f"{flag} up to {sum(gb) / 1e9:.3f} GB, more than the host's "
                                       f"{capacity_bytes / 1e9:.3f} GB of replica memory; lower them or give the host more")
        return Shares(tuple(self._firsts), guaranteed, active_s, warm, self.shared())

    def extend(self, shares: Shares) -> Shares:
        """shares (made for the models served before) over every model served now: a model added since
        has no guarantee and no keep-warm set, and counts as a user of the keys it shares."""
        more = (0,) * (len(self._ranges) - len(shares.guaranteed))
        return Shares(tuple(self._firsts), shares.guaranteed + more, shares.active_s,
                      shares.warm + more if shares.warm else (), self.shared())

    def model_of(self, layer: int) -> ModelRange:
        """The model whose layers include host layer `layer`."""
        return self._ranges[self._which(layer)]

    def describe(self) -> str:
        return ", ".join(f"{r.name} (layers {r.first_layer}-{r.first_layer + r.layers - 1}, {r.experts} experts)"
                         for r in self._ranges)

    def _which(self, layer: int) -> int:
        return bisect_right(self._firsts, layer) - 1

    def _local(self, layer: int) -> tuple[WeightStore, int]:
        if not 0 <= layer < self.num_layers:
            raise WeightStoreError(f"no layer {layer} on this host: it serves {self.describe()}")
        i = self._which(layer)
        return self.stores[i], layer - self._ranges[i].first_layer


def as_model_stores(store: "WeightStore | ModelStores") -> ModelStores:
    """A host's store as ModelStores (one plain WeightStore: one model, named as ModelStores.open names it)."""
    if isinstance(store, ModelStores):
        return store
    return ModelStores([(str(store.index.get("model") or Path(store.root).name), store)])
