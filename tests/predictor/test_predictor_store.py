"""Predictor files: every module and its metadata round-trip; another model's file is refused."""

import numpy as np
import pytest

from moeless.model.tiny import tiny_model
from moeless.predictor.finetune import FitConfig, layer_aware_finetune
from moeless.predictor.scratch import train_scratch
from moeless.predictor.store import PredictorFileError, load_predictor, save_predictor


@pytest.mark.parametrize("method", ["gate_replica", "mlp"])
def test_saved_predictor_predicts_the_same_after_loading(method, sliced, sliced_traces, tmp_path):
    fit, val = sliced_traces.split("train").holdout()
    pairs = [(0, 1), (1, 0)]
    config = FitConfig(threshold=1.01, max_epochs=2)
    train = layer_aware_finetune if method == "gate_replica" else train_scratch
    predictor, reports = train(sliced, fit, val, pairs, config, progress=False)
    accuracy = {f"{l}/{d}": r.as_dict() for (l, d), r in reports.items()}
    path = save_predictor(tmp_path / "p.pt", predictor, sliced, {"accuracy": accuracy})
    loaded, meta = load_predictor(path, sliced)
    assert loaded.name == method and meta["distances"] == [0, 1] and meta["accuracy"] == accuracy
    trace = sliced_traces.traces[0]
    for l, d in pairs:
        a = predictor.predict(l, d, trace.hidden[l], trace.trajectory[: l + 1].numpy())
        b = loaded.predict(l, d, trace.hidden[l], trace.trajectory[: l + 1].numpy())
        np.testing.assert_array_equal(a.topk, b.topk)


def test_a_file_of_another_model_is_refused(sliced, sliced_traces, tmp_path):
    fit, val = sliced_traces.split("train").holdout()
    predictor, _ = layer_aware_finetune(sliced, fit, val, [(0, 1)], FitConfig(threshold=0.0), progress=False)
    path = save_predictor(tmp_path / "p.pt", predictor, sliced, {})
    with pytest.raises(PredictorFileError, match="retrain"):
        load_predictor(path, tiny_model("moeless-sliced", seed=1))
    with pytest.raises(PredictorFileError, match="no such predictor file"):
        load_predictor(tmp_path / "missing.pt", sliced)
