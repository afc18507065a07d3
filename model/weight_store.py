"""The per-expert weight store: one safetensors file per (layer, expert), an index, checksums.

Layout of a store directory:

    index.json                     {"format", "model", "num_layers", "num_experts", "act",
                                    "dtype", "experts": {"<l>/<e>": {"file", "sha256", "bytes"}}}
    experts/l000_e000.safetensors  tensors "gate" [F, H], "up" [F, H], "down" [H, F]

Expert functions load single experts from it: `load` takes one pass over the file, checks its
sha256 on the bytes it read and parses them, so a corrupt or missing file fails that one load
with an error naming the file. An expert host verifies a file once, when it enters its host
memory tier (expert_fn/stores/tiers.py); copies from that tier need no further check.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Callable, Iterable, Iterator

import torch
from safetensors.torch import load as parse_safetensors
from safetensors.torch import save_file

from moeless.core.paths import cache_dir
from moeless.model.experts import EXPERT_TENSORS

if TYPE_CHECKING:
    from moeless.model.moe_model import MoEModel

FORMAT = "moeless-weight-store/1"


class WeightStoreError(RuntimeError):
    """A weight store or one of its files is missing, corrupt or inconsistent."""


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def expert_key(layer: int, expert: int) -> str:
    return f"{layer}/{expert}"


@dataclass(frozen=True)
class WeightStore:
    """An opened weight store (read-only)."""

    root: Path
    index: dict

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
        return WeightStore(root, index)

    def expert_bytes(self, layer: int, expert: int) -> int:
        return int(self._entry(layer, expert)["bytes"])

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
            data = path.read_bytes()
        except FileNotFoundError:
            raise WeightStoreError(f"{path}: expert weight file is missing; re-export the store") from None
        except OSError as err:
            raise WeightStoreError(f"{path}: cannot read expert weights ({err.strerror}); check the store") from err
        if verify and hashlib.sha256(data).hexdigest() != entry["sha256"]:
            raise WeightStoreError(f"{path}: checksum mismatch, the file is corrupt; re-export the store")
        try:
            tensors = parse_safetensors(data)
            return {name: tensors[name] for name in EXPERT_TENSORS}
        except Exception as err:  # safetensors raises several types for damaged files; KeyError for a missing tensor
            raise WeightStoreError(f"{path}: cannot read expert weights ({err}); re-export the store") from err


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
) -> WeightStore:
    """Write a store from (layer, expert, weights) triples; returns it opened.

    weights: {"gate": [F, H], "up": [F, H], "down": [H, F]}; saved contiguous, as given dtype.
    """
    root = Path(root)
    (root / "experts").mkdir(parents=True, exist_ok=True)
    entries: dict[str, dict] = {}
    dtype = None
    for layer, expert, weights in experts:
        missing = set(EXPERT_TENSORS) - set(weights)
        if missing:
            raise WeightStoreError(f"expert (layer {layer}, expert {expert}) lacks tensors {sorted(missing)}")
        rel = f"experts/l{layer:03d}_e{expert:03d}.safetensors"
        save_file({n: weights[n].detach().contiguous() for n in EXPERT_TENSORS}, str(root / rel))
        dtype = str(weights["gate"].dtype).removeprefix("torch.")
        entries[expert_key(layer, expert)] = {
            "file": rel,
            "sha256": _sha256(root / rel),
            "bytes": sum(weights[n].numel() * weights[n].element_size() for n in EXPERT_TENSORS),
        }
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
    (root / "index.json").write_text(json.dumps(index, indent=1))
    return WeightStore(root, index)


def export_store(model: "MoEModel", name: str) -> Path:
    """The model's experts as a weight store under the cache dir, keyed by a hash of their weights."""
    digest = hashlib.sha256(repr(model.spec).encode())
    for _, _, weights in model.iter_experts():
        for tensor in weights.values():
            digest.update(tensor.detach().contiguous().view(torch.uint8).numpy().tobytes())  # any dtype's bytes
    spec = model.spec
    return cached_store(name, digest.hexdigest()[:16], lambda root: export_experts(
        model.iter_experts(), root, model=name, num_layers=spec.num_layers, num_experts=spec.num_experts, act=spec.act))


def cached_store(name: str, key: str, write: Callable[[Path], object]) -> Path:
    """The weight store <cache>/stores/<name>-<key> (name made path-safe), written by write(root)
    the first time it is asked for and reused after (key: what tells its contents apart)."""
    root = cache_dir() / "stores" / f"{re.sub(r'[^A-Za-z0-9_.-]', '_', name)}-{key}"
    try:
        return WeightStore.open(root).root
    except WeightStoreError:
        write(root)
        return root
