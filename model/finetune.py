"""Fine-tune artefacts ("moeless-finetune/1"): a base model plus only what a fine-tune changed.

A fine-tune directory holds finetune.json and either the replaced experts (ESFT) or a PEFT adapter
folder (LoRA); every byte not in it comes from the base, which finetune.json names and fingerprints:

    finetune.json                   {"format": "moeless-finetune/1", "name", "method": "esft" | "lora",
                                     "base": {"name", "path", "fingerprint", "num_layers", "num_experts",
                                              "hidden_size", "expert_ffn"},
                                     "task", "selection" (esft), "lora" (lora), "training", "perplexity",
                                     "experts": [{"layer", "expert", "file", "sha256", "bytes"}, ...]}
    experts/l000_e003.safetensors   ESFT: one replaced expert, tensors "gate" [F, H], "up" [F, H],
                                    "down" [H, F], exactly as the weight store (model/weight_store.py)
    adapter/                        LoRA: adapter_config.json + adapter_model.safetensors (peft's own)

A loader never trusts a file it was given: the base's fingerprint, every replaced expert's shape
and every expert file's sha256 are checked, and each refusal is one line naming the fine-tune and
the expert or file at fault (FinetuneError).
"""

from __future__ import annotations

import copy
import hashlib
import json
from pathlib import Path
from typing import Iterable

import torch
from safetensors.torch import save_file

from moeless.core.paths import cache_dir
from moeless.model.checked_file import CheckedFileError, read_checked
from moeless.model.experts import EXPERT_TENSORS
from moeless.model.moe_model import MoEModel


FORMAT = "moeless-finetune/1"
MANIFEST = "finetune.json"
METHODS = ("esft", "lora")


class FinetuneError(RuntimeError):
    """A fine-tune directory is missing, malformed, corrupt, or made for another base."""


def weights_fingerprint(model: MoEModel) -> str:
    """sha256 (hex) over the model's spec and every tensor of its state dict (name, shape, dtype,
    bytes): the identity of a base. Every byte counts (predictor/fingerprint.model_hash samples
    4,096 elements per tensor, which cannot tell two ESFT fine-tunes of one base apart). ~1 s for
    the default model's 540 MB."""
    h = hashlib.sha256(repr(model.spec).encode())
    with torch.no_grad():
        for name, tensor in sorted(model.hf.state_dict().items()):
            h.update(f"{name}:{tuple(tensor.shape)}:{tensor.dtype}".encode())
            h.update(tensor.detach().contiguous().reshape(-1).view(torch.uint8).numpy())
    return h.hexdigest()


def model_name(model: MoEModel) -> str:
    """A name for messages: the directory the model was loaded from, else its arch and shape."""
    path = str(getattr(model.hf.config, "name_or_path", "") or "")
    spec = model.spec
    return Path(path).name if path else f"a {spec.arch} model of {spec.num_layers} x {spec.num_experts} experts"


def base_record(base: MoEModel, name: str, path: str | Path | None = None) -> dict:
    """finetune.json's "base": what a loader needs to find the base and to refuse any other."""
    spec = base.spec
    return {"name": name, "path": None if path is None else str(Path(path).resolve()),
            "fingerprint": weights_fingerprint(base), "num_layers": spec.num_layers,
            "num_experts": spec.num_experts, "hidden_size": spec.hidden_size, "expert_ffn": spec.expert_ffn}


def expert_file(layer: int, expert: int) -> str:
    """The relative path of a replaced expert's file (the weight store's naming)."""
    return f"experts/l{layer:03d}_e{expert:03d}.safetensors"


def write_manifest(out: str | Path, manifest: dict) -> Path:
    """Write finetune.json into `out` (format and method checked); returns the directory."""
    out = Path(out)
    if manifest.get("method") not in METHODS:
        raise ValueError(f"method must be one of {METHODS}, got {manifest.get('method')!r}")
    out.mkdir(parents=True, exist_ok=True)
    (out / MANIFEST).write_text(json.dumps({"format": FORMAT, **manifest}, indent=1))
    return out


def save_esft(out: str | Path, tuned: MoEModel, replaced: Iterable[tuple[int, int]], manifest: dict) -> Path:
    """Write an ESFT fine-tune: tuned's weights of the replaced (layer, expert)s, one file each, and
    finetune.json (manifest plus method "esft" and the experts' list with checksums)."""
    out = Path(out)
    (out / "experts").mkdir(parents=True, exist_ok=True)
    entries = []
    for layer, expert in sorted(set(replaced)):
        weights = tuned.expert_weights(layer, expert)
        rel = expert_file(layer, expert)
        save_file({n: weights[n].detach().contiguous() for n in EXPERT_TENSORS}, str(out / rel))
        entries.append({"layer": layer, "expert": expert, "file": rel,
                        "sha256": hashlib.sha256((out / rel).read_bytes()).hexdigest(),
                        "bytes": sum(weights[n].numel() * weights[n].element_size() for n in EXPERT_TENSORS)})
    return write_manifest(out, {**manifest, "method": "esft", "experts": entries})


def read_manifest(root: str | Path) -> dict:
    """finetune.json of fine-tune directory `root`, checked for format and the fields loaders use."""
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise FinetuneError(f"{path}: missing; is {root} a fine-tune directory (`moeless model finetune` makes one)?")
    try:
        manifest = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise FinetuneError(f"{path}: not valid JSON ({err})") from err
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FinetuneError(f"{path}: format {manifest.get('format') if isinstance(manifest, dict) else None!r}, "
                            f"expected {FORMAT!r}")
    missing = [k for k in ("name", "method", "base", "experts") if k not in manifest]
    if missing or manifest["method"] not in METHODS or "fingerprint" not in manifest["base"]:
        raise FinetuneError(f"{path}: lacks {missing or ['a known method and base fingerprint']}; remake the fine-tune")
    return manifest


def resolve_base(manifest: dict, base: MoEModel | None) -> MoEModel:
    """The base a fine-tune names: `base` when given, else the model under the cache (its name) or
    at its recorded path. Refuses, in one line, a missing base or one whose fingerprint differs."""
    name, want = manifest["name"], manifest["base"]
    wanted = f"base {want['name']} (fingerprint {want['fingerprint'][:16]})"
    if base is None:
        # transformers only where the base must be found and loaded
        from moeless.model.hf_loader import load_moe_model

        places = [cache_dir() / want["name"]] + ([Path(want["path"])] if want.get("path") else [])
        found = next((p for p in places if (p / "config.json").is_file()), None)
        if found is None:
            raise FinetuneError(f"fine-tune {name} needs {wanted}, found no model at {' or '.join(map(str, places))}")
        base = load_moe_model(found)
    check_shapes(manifest, base)
    got = weights_fingerprint(base)
    if got != want["fingerprint"]:
        raise FinetuneError(f"fine-tune {name} needs {wanted}, found {model_name(base)} (fingerprint {got[:16]})")
    return base


def check_shapes(manifest: dict, base: MoEModel) -> None:
    """Every replaced expert exists in base with the shapes the fine-tune recorded for it."""
    name, want, spec = manifest["name"], manifest["base"], base.spec
    for entry in manifest["experts"]:
        layer, expert = int(entry["layer"]), int(entry["expert"])
        if not (0 <= layer < spec.num_layers and 0 <= expert < spec.num_experts):
            raise FinetuneError(f"fine-tune {name}: expert ({layer}, {expert}) is not in base {model_name(base)} "
                                f"({spec.num_layers} layers x {spec.num_experts} experts)")
    shape = [want["expert_ffn"], want["hidden_size"]]
    if (spec.expert_ffn, spec.hidden_size) != tuple(shape) and manifest["experts"]:
        first = manifest["experts"][0]
        raise FinetuneError(f"fine-tune {name}: expert ({first['layer']}, {first['expert']}) is {shape} but base "
                            f"{model_name(base)}'s is [{spec.expert_ffn}, {spec.hidden_size}]")


def read_expert(root: str | Path, manifest: dict, entry: dict, spec=None) -> dict[str, torch.Tensor]:
    """One replaced expert's weights from its file, its sha256 checked on the bytes read and, with
    spec (the base's MoESpec), each tensor's shape against the base's [F, H] / [H, F]."""
    path = Path(root) / entry["file"]
    try:
        weights = read_checked(path, entry["sha256"], "expert weight file", EXPERT_TENSORS)
    except CheckedFileError as err:
        raise FinetuneError(f"fine-tune {manifest['name']}: {path}: {err}") from None
    if spec is not None:
        f, h = spec.expert_ffn, spec.hidden_size
        for n, want in (("gate", [f, h]), ("up", [f, h]), ("down", [h, f])):
            if list(weights[n].shape) != want:
                raise FinetuneError(f"fine-tune {manifest['name']}: expert ({entry['layer']}, {entry['expert']}) "
                                    f"{n} is {list(weights[n].shape)} but base {manifest['base']['name']}'s is {want}")
    return weights


def replaced_experts(root: str | Path, spec=None) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """{(layer, expert): weights} of an ESFT fine-tune, each file verified (what an expert host
    loads for the experts a fine-tune owns; the others are the base's)."""
    manifest = read_manifest(root)
    return {(int(e["layer"]), int(e["expert"])): read_expert(root, manifest, e, spec) for e in manifest["experts"]}


def perturbed(base: MoEModel, experts: Iterable[tuple[int, int]], scale: float, seed: int) -> MoEModel:
    """A stand-in fine-tune for tests: a copy of base with each (layer, expert) in `experts` plus
    scale x N(0, 1) noise (seeded; in the given order), not trained: an ESFT fine-tune's shape."""
    tuned = MoEModel(copy.deepcopy(base.hf), tokenizer=base.tokenizer)
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer, expert in experts:
            for t in tuned.expert_weights(layer, expert).values():
                t.add_(scale * torch.randn(t.shape, generator=g))
    return tuned

def merge_experts(base: MoEModel, experts: dict[tuple[int, int], dict[str, torch.Tensor]]) -> MoEModel:
    """A new MoEModel: a copy of base with the given experts' weights written over its own (base is
    not modified; every other tensor is the base's, bit for bit)."""
    hf = copy.deepcopy(base.hf)
    merged = MoEModel(hf, tokenizer=base.tokenizer)
    with torch.no_grad():
        for (layer, expert), weights in experts.items():
            views = merged.expert_weights(layer, expert)
            for n in EXPERT_TENSORS:
                views[n].copy_(weights[n])
    return merged

