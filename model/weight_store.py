"""The per-expert weight store: one safetensors file per (layer, expert), an index, checksums, keys.

Layout of a store directory:

    index.json                     {"format", "model", "num_layers", "num_experts", "act", "dtype",
                                    "experts": {"<l>/<e>": {"file", "sha256", "bytes", "key"}},
                                    "base": {"model", "store"} (a store over a base only),
                                    "loras": {"<l>/<e>": {"file", "sha256", "bytes"}} (a LoRA fine-tune's)}
    experts/l000_e000.safetensors  tensors "gate" [F, H], "up" [F, H], "down" [H, F]
    loras/l000_e000.safetensors    a LoRA fine-tune's factors of that expert (model/lora_store.py)

Each expert has a content key (model/content_keys.py: dtype, shape and the file's sha256), so
experts of different models that are the same bytes are one function to an expert host
(expert_fn/stores/model_stores.py). A store written before keys existed opens all the same: its
keys come from the sha256 it recorded and each file's header.

A store over a base (a fine-tune's: `export_experts(..., base=store)`) writes only the experts
whose keys its base lacks; every other entry names the base's file (its path relative to this
store, `"in_base": true`) and the base is recorded relative to this store's directory, so a folder
of stores moves as one. Opening such a store checks, in one line naming the model and the
expert, that the base is there, that the base's files are the bytes this store was written
against, and that every expert of its own has its base expert's dtype and shape.

Expert functions load single experts from it: `load` takes one pass over the file, checks its
sha256 on the bytes it read and parses them, so a corrupt or missing file fails that one load
with an error naming the file. An expert host verifies a file once, when it enters its host
memory tier (expert_fn/stores/tiers.py); copies from that tier need no further check.
"""

from __future__ import annotations

import hashlib
import json
import os
import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from safetensors.torch import save as serialise

from moeless.core.paths import cache_dir
from moeless.model.checked_file import CheckedFileError, read_checked
from moeless.model.content_keys import NotAnExpertFile, content_key, file_key, key_shape
from moeless.model.experts import EXPERT_TENSORS
from moeless.model.lora_store import FactorFileError, Lora, loras_digest, read_factors, write_factors

if TYPE_CHECKING:
    from moeless.model.moe_model import MoEModel

FORMAT = "moeless-weight-store/1"


class WeightStoreError(RuntimeError):
    """A weight store or one of its files is missing, corrupt or inconsistent."""


def expert_key(layer: int, expert: int) -> str:
    return f"{layer}/{expert}"


@dataclass(frozen=True)
class WeightStore:
    """An opened weight store (read-only)."""

    root: Path
    index: dict
    _keys: dict = field(default_factory=dict, compare=False, repr=False)  # (layer, expert) -> key, computed once

    @property
    def num_layers(self) -> int:
        return int(self.index["num_layers"])

    @property
    def num_experts(self) -> int:
        return int(self.index["num_experts"])

    @property
    def act(self) -> str:
        return str(self.index["act"])

    @staticmethod
    def open(root: str | Path) -> "WeightStore":
        root = Path(root)
        index_path = root / "index.json"
        if not index_path.is_file():
            raise WeightStoreError(f"{index_path}: no weight-store index; export one with `moeless model export`")
        try:
            index = json.loads(index_path.read_text())
        except json.JSONDecodeError as err:
            raise WeightStoreError(f"{index_path}: not valid JSON ({err}); re-export the store") from err
        if index.get("format") != FORMAT:
            raise WeightStoreError(f"{index_path}: format {index.get('format')!r}, expected {FORMAT!r}")
        store = WeightStore(root, index)
        if "base" in index:
            check_over_base(store)
        return store

    @property
    def model(self) -> str:
        return str(self.index.get("model") or self.root.name)

    def key(self, layer: int, expert: int) -> str:
        """Expert (layer, expert)'s content key (model/content_keys.py); a store written before keys
        existed: from its recorded sha256 and the file's header, read once."""
        if (layer, expert) not in self._keys:
            entry = self._entry(layer, expert)
            if "key" in entry:
                self._keys[(layer, expert)] = entry["key"]
            else:
                try:
                    self._keys[(layer, expert)] = file_key(self.root / entry["file"], entry["sha256"])
                except NotAnExpertFile as err:
                    raise WeightStoreError(f"model {self.model}: expert ({layer}, {expert}): {err}") from None
        return self._keys[(layer, expert)]

    def in_base(self, layer: int, expert: int) -> bool:
        """Whether (layer, expert) is its base store's file (a store over a base), not one of its own."""
        return bool(self._entry(layer, expert).get("in_base"))

    def expert_bytes(self, layer: int, expert: int) -> int:
        return int(self._entry(layer, expert)["bytes"])

    def loras(self) -> dict[tuple[int, int], Lora]:
        """Every expert LoRA of a LoRA fine-tune's store, applied at call time over its (base's) expert
        (model/lora_store.py); each file verified, WeightStoreError naming the model and the expert."""
        out = {}
        for name, entry in sorted(self.index.get("loras", {}).items()):
            layer, expert = map(int, name.split("/"))
            try:
                out[(layer, expert)] = read_factors(self.root, entry, self.model, layer, expert)
            except FactorFileError as err:
                raise WeightStoreError(str(err)) from None
        return out

    def has(self, layer: int, expert: int) -> bool:
        return 0 <= layer < self.num_layers and 0 <= expert < self.num_experts

    def keys(self) -> Iterator[tuple[int, int]]:
        """Every (layer, expert) of the store."""
        for layer in range(self.num_layers):
            for expert in range(self.num_experts):
                yield layer, expert

    def _entry(self, layer: int, expert: int) -> dict:
        try:
            return self.index["experts"][expert_key(layer, expert)]
        except KeyError:
            raise WeightStoreError(
                f"{self.root / 'index.json'}: no expert (layer {layer}, expert {expert}); "
                f"the store has {self.num_layers} layers x {self.num_experts} experts"
            ) from None

    def load(self, layer: int, expert: int, verify: bool = True) -> dict[str, torch.Tensor]:
        """The weights of expert (layer, expert): {"gate", "up", "down"}, in fresh memory.

        One read of the file; with verify its sha256 is checked on those bytes before parsing.
        Raises WeightStoreError naming the file when it is missing, fails its checksum, or
        lacks a tensor.
        """
        entry = self._entry(layer, expert)
        path = self.root / entry["file"]
        try:
            return read_checked(path, entry["sha256"] if verify else None, "expert weight file", EXPERT_TENSORS)
        except CheckedFileError as err:
            raise WeightStoreError(f"{path}: {err}; re-export the store") from None


def stored_dtype(store: "WeightStore") -> torch.dtype:
    """The dtype store's experts are held in (float32 for a store that does not say)."""
    return getattr(torch, store.index.get("dtype") or "float32")


def export_experts(
    experts: Iterable[tuple[int, int, dict[str, torch.Tensor]]],
    root: str | Path,
    *,
    model: str,
    num_layers: int,
    num_experts: int,
    act: str,
    base: "WeightStore | None" = None,
    loras: dict[tuple[int, int], Lora] | None = None,
) -> WeightStore:
    """Write a store from (layer, expert, weights) triples; returns it opened.

    weights: {"gate": [F, H], "up": [F, H], "down": [H, F]}; saved contiguous, as given dtype.
    base: a store this one is written over: an expert whose key the base has is not written but
    names the base's file (module docstring); an expert of its own must have the dtype and shape of
    the base's expert at its place (WeightStoreError naming the model and the expert).
    loras: a LoRA fine-tune's expert factors ({(layer, expert): LoRA dict}, model/lora_store.py).
    """
    root = Path(root)
    (root / "experts").mkdir(parents=True, exist_ok=True)
    in_base = {base.key(l, e): (l, e) for l, e in base.keys()} if base is not None else {}
    entries: dict[str, dict] = {}
    dtype = None
    for layer, expert, weights in experts:
        missing = set(EXPERT_TENSORS) - set(weights)
        if missing:
            raise WeightStoreError(f"expert (layer {layer}, expert {expert}) lacks tensors {sorted(missing)}")
        data = serialise({n: weights[n].detach().contiguous() for n in EXPERT_TENSORS})
        key = content_key(data)
        dtype = str(weights["gate"].dtype).removeprefix("torch.")
        entry = {"sha256": key.rsplit("-", 1)[1], "key": key,
                 "bytes": sum(weights[n].numel() * weights[n].element_size() for n in EXPERT_TENSORS)}
        if key in in_base:
            entry |= {"file": os.path.relpath(base.root / base._entry(*in_base[key])["file"], root), "in_base": True}
        else:
            if base is not None:
                _check_shape(model, base, layer, expert, key)
            entry["file"] = f"experts/l{layer:03d}_e{expert:03d}.safetensors"
            (root / entry["file"]).write_bytes(data)
        entries[expert_key(layer, expert)] = entry
    if len(entries) != num_layers * num_experts:
        raise WeightStoreError(f"expected {num_layers * num_experts} experts, got {len(entries)}")
    index = {
        "format": FORMAT,
        "model": model,
        "num_layers": num_layers,
        "num_experts": num_experts,
        "act": act,
        "dtype": dtype,
        "experts": entries,
    }
    if base is not None:
        index["base"] = {"model": base.model, "store": os.path.relpath(base.root, root)}
    if loras:
        index["loras"] = write_factors(root, loras)
    (root / "index.json").write_text(json.dumps(index, indent=1))
    return WeightStore(root, index)


def check_over_base(store: WeightStore) -> None:
    """A store over a base (module docstring): its base is there with the geometry and the bytes this
    store was written against, and its own experts have their base experts' dtype and shape."""
    name, base_ref = store.model, store.index["base"]
    base_root = (store.root / base_ref["store"]).resolve()
    shared = [(l, e) for l, e in store.keys() if store.in_base(l, e)]
    first = f"expert {shared[0]}" if shared else "its experts"
    try:
        base = WeightStore.open(base_root)
    except WeightStoreError as err:
        raise WeightStoreError(f"model {name}: {first} is base {base_ref['model']}'s, whose store {base_root} cannot be "
                               f"opened ({err}); export the base there first") from None
    if (base.num_layers, base.num_experts) != (store.num_layers, store.num_experts):
        raise WeightStoreError(f"model {name}: {store.num_layers} layers x {store.num_experts} experts, its base "
                               f"{base.model} {base.num_layers} x {base.num_experts}; a fine-tune keeps its base's geometry")
    recorded = {(base_root / entry["file"]).resolve(): entry["sha256"] for entry in base.index["experts"].values()}
    for layer, expert in store.keys():
        entry = store._entry(layer, expert)
        if entry.get("in_base"):
            if recorded.get((store.root / entry["file"]).resolve()) != entry["sha256"]:
                raise WeightStoreError(f"model {name}: expert ({layer}, {expert}) is base {base.model}'s file "
                                       f"{entry['file']}, which is not the bytes this store was written over; "
                                       "export this store again")
        else:
            _check_shape(name, base, layer, expert, store.key(layer, expert))


def _check_shape(name: str, base: WeightStore, layer: int, expert: int, key: str) -> None:
    """An expert of a store over `base` has the dtype and shape of the base's at its place."""
    if not base.has(layer, expert):
        raise WeightStoreError(f"model {name}: expert ({layer}, {expert}) is not in base {base.model} "
                               f"({base.num_layers} layers x {base.num_experts} experts)")
    mine, theirs = key_shape(key), key_shape(base.key(layer, expert))
    if mine != theirs:
        raise WeightStoreError(f"model {name}: expert ({layer}, {expert}) is {mine}, its base {base.model}'s is {theirs}")


def export_store(model: "MoEModel", name: str, base: str | Path | None = None) -> Path:
    """The model's experts as a weight store under the cache dir, keyed by a hash of their weights
    (and of its base's index, with base: a store this one is written over, export_experts). A LoRA
    fine-tune loaded with its expert LoRAs unmerged (model/lora.py's LoraMoEModel: its experts are
    its base's) writes its factors too, so a host applies them over the base's shared replicas."""
    digest = hashlib.sha256(repr(model.spec).encode())
    for _, _, weights in model.iter_experts():
        for tensor in weights.values():
            digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())  # any dtype's bytes
    loras = getattr(model, "expert_loras", None)  # a LoraMoEModel's ({(layer, expert): factors})
    if loras:  # only then: the keys of stores without factors stay what they were
        digest.update(loras_digest(loras))
    over = WeightStore.open(base) if base is not None else None
    if over is not None:
        digest.update((over.root / "index.json").read_bytes())
    spec = model.spec
    return cached_store(name, digest.hexdigest()[:16], lambda root: export_experts(
        model.iter_experts(), root, model=name, num_layers=spec.num_layers, num_experts=spec.num_experts, act=spec.act,
        base=over, loras=loras))


def cached_store(name: str, key: str, write: Callable[[Path], object]) -> Path:
    """The weight store <cache>/stores/<name>-<key> (name made path-safe), written by write(root)
    the first time it is asked for and reused after (key: what tells its contents apart)."""
    root = cache_dir() / "stores" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{key}"
    try:
        return WeightStore.open(root).root
    except WeightStoreError:
        write(root)
        return root
