"""One file per trained predictor: every (l, d) module's weights plus the metadata to trust them
(the model's fingerprint, distances, per-pair accuracies, the training settings).

Loading insists on the same model: a predictor of another model would silently mispredict.
"""

from __future__ import annotations

from pathlib import Path

import torch

from moeless.core.paths import cache_dir
from moeless.predictor.fingerprint import model_hash
from moeless.predictor.gate_replica import ModulePredictor, Pair, gate_copies, gate_route, topk_route
from moeless.predictor.scratch import scratch_mlp

FORMAT = "moeless-predictor/1"
KINDS = {"gate_replica": "gate", "gate_reuse": "gate", "mlp": "mlp"}  # method -> how its modules are rebuilt


class PredictorFileError(ValueError):
    """A predictor file that is unreadable or belongs to another model."""


def default_path(model) -> Path:
    """Where `moeless predictor train` keeps a model's gate replicas: <cache>/predictor/gate-replicas-<hash>.pt."""
    return cache_dir() / "predictor" / f"gate-replicas-{model_hash(model)}.pt"


def _key(pair: Pair) -> str:
    return f"{pair[0]}/{pair[1]}"


def save_predictor(path: str | Path, predictor: ModulePredictor, model, metadata: dict) -> Path:
    """Write `predictor` (gate replicas, gate reuse or MLPs of `model`) and metadata to one file.

    metadata: JSON-like extras, e.g. {"accuracy": {"l/d": {...}}, "config": {...}}.
    """
    if predictor.name not in KINDS:
        raise PredictorFileError(f"cannot store predictor {predictor.name!r}; storable: {sorted(KINDS)}")
    pairs = sorted(predictor.modules)
    doc = {
        "format": FORMAT,
        "method": predictor.name,
        "model_hash": model_hash(model),
        "distances": sorted({d for _, d in pairs}),
        "pairs": [list(p) for p in pairs],
        "state": {_key(p): predictor.modules[p].state_dict() for p in pairs},
        **metadata,
    }
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    torch.save(doc, path)
    return path


def load_predictor(path: str | Path, model) -> tuple[ModulePredictor, dict]:
    """(predictor, the file's metadata) for `model`; refuses files of another model."""
    path = Path(path)
    if not path.is_file():
        raise PredictorFileError(f"{path}: no such predictor file; create one with `moeless predictor train --out {path}`")
    doc = torch.load(path, weights_only=True)
    if doc.get("format") != FORMAT:
        raise PredictorFileError(f"{path}: not a moeless predictor file (format {doc.get('format')!r}, expected {FORMAT!r})")
    if doc["model_hash"] != model_hash(model):
        raise PredictorFileError(f"{path}: trained for model {doc['model_hash']}, not this model ({model_hash(model)}); retrain it")
    pairs = [tuple(p) for p in doc["pairs"]]
    spec = model.spec
    if KINDS[doc["method"]] == "gate":
        modules, route = gate_copies(model, pairs), gate_route(model)
    else:
        width = int(doc["state"][_key(pairs[0])]["0.weight"].shape[0])
        modules = {p: scratch_mlp(spec.hidden_size, spec.num_experts, width).eval() for p in pairs}
        route = topk_route(spec.top_k)
    for pair, module in modules.items():
        module.load_state_dict(doc["state"][_key(pair)])
        module.requires_grad_(False)
    metadata = {k: v for k, v in doc.items() if k != "state"}
    return ModulePredictor(doc["method"], modules, route, spec.num_experts), metadata
