"""The prediction runtime the `predictor` knob asks for, for one model: what a serving replica
forecasts with in its forward pass (serving/live_executor.py)."""

from __future__ import annotations

import logging

from moeless.predictor.gate_replica import all_pairs, gate_reuse
from moeless.predictor.history import HistoryPredictor
from moeless.predictor.runtime import PredictionRuntime
from moeless.predictor.store import PredictorFileError, default_path, load_predictor

log = logging.getLogger(__name__)


def build_predictor(model, predictor: str, distance: int, path: str | None = None) -> PredictionRuntime | None:
    """The prediction runtime of the `predictor` knob for `model` (call before drop_experts: the
    predictor file is checked against the full model): "gate": the trained gate replicas of
    `moeless predictor train` (path, else the cache's file for this model), or, when there is
    none, the untrained gate copies (gate reuse), said in the log; the history window as the
    fallback. "history" and "off": None (the loop plans from the reported actual loads, or not
    at all)."""
    if predictor != "gate":
        return None
    spec = model.spec
    file = path or str(default_path(model))
    try:
        primary, meta = load_predictor(file, model)
        if distance not in meta["distances"]:
            raise PredictorFileError(f"{file}: trained for distances {meta['distances']}, not {distance}")
        log.info("predictor: gate replicas from %s at distance %d", file, distance)
    except PredictorFileError as err:
        if path:
            raise
        log.warning("predictor: %s; forecasting with untrained gate copies (train them with `moeless predictor "
                    "train --distances %d` for better forecasts)", err, distance)
        primary = gate_reuse(model, all_pairs(spec.num_layers, [distance]))
    return PredictionRuntime(primary, HistoryPredictor(spec.num_layers, spec.num_experts, spec.top_k))
