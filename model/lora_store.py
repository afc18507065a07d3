"""A LoRA fine-tune's expert factors in a weight store (model/weight_store.py): one small safetensors
file per (layer, expert) its adapter touches, beside experts that are all its base's.

A LoRA on an expert is applied at call time over the base's replica (ExpertWeave's way:
model/experts.expert_forward_lora), so the fine-tune's store names every expert by the base's
content key (no expert bytes copied) and carries only the factors:

    index.json  "loras": {"<l>/<e>": {"file", "sha256", "bytes"}}
    loras/l000_e003.safetensors    "gate_A" [r, H], "gate_B" [F, r], "up_A", "up_B", "down_A" [r, F],
                                   "down_B" [H, r] (the adapted matrices only; B scaled by alpha / r)

A file is read in one pass, its sha256 checked on the bytes read; a missing, corrupt or unreadable
file is refused in one line naming the model and the expert (FactorFileError).
"""

from __future__ import annotations

import hashlib
from pathlib import Path

import torch
from safetensors.torch import save as serialise

from moeless.model.checked_file import CheckedFileError, read_checked

Lora = dict[str, torch.Tensor]


class FactorFileError(ValueError):
    """A LoRA factor file is missing, corrupt or unreadable (the message names the model and the expert)."""


def factor_file(layer: int, expert: int) -> str:
    return f"loras/l{layer:03d}_e{expert:03d}.safetensors"


def factor_bytes(lora: Lora) -> int:
    """The bytes of one expert's factors as stored."""
    return sum(t.numel() * t.element_size() for t in lora.values())


def write_factors(root: Path, loras: dict[tuple[int, int], Lora]) -> dict[str, dict]:
    """Write each expert's factors under root/loras/ -> the index's "loras" entries by "<l>/<e>"."""
    if loras:
        (root / "loras").mkdir(parents=True, exist_ok=True)
    entries = {}
    for (layer, expert), lora in sorted(loras.items()):
        data = serialise({n: t.detach().contiguous() for n, t in sorted(lora.items())})
        rel = factor_file(layer, expert)
        (root / rel).write_bytes(data)
        entries[f"{layer}/{expert}"] = {"file": rel, "sha256": hashlib.sha256(data).hexdigest(),
                                        "bytes": factor_bytes(lora)}
    return entries


def read_factors(root: Path, entry: dict, model: str, layer: int, expert: int) -> Lora:
    """One expert's factors, the file's sha256 checked on the bytes read; FactorFileError naming
    the model and the expert for a missing, corrupt or unreadable file."""
    path = root / entry["file"]
    try:
        return read_checked(path, entry["sha256"], "LoRA factor file")
    except CheckedFileError as err:
        raise FactorFileError(f"model {model}: expert ({layer}, {expert}): {path}: {err}; export the store again") from None


def loras_digest(loras: dict[tuple[int, int], Lora] | None) -> bytes:
    """A digest of every factor (a cached store's key must change with them)."""
    h = hashlib.sha256()
    for (layer, expert), lora in sorted((loras or {}).items()):
        h.update(f"{layer}/{expert}".encode())
        for name, t in sorted(lora.items()):
            h.update(name.encode())
            h.update(t.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.digest()
