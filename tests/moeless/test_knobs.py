"""The serving knobs: one vocabulary for flags, YAML and the policy; clear errors naming the key."""

from __future__ import annotations

import argparse

import pytest

from moeless.controller.knobs import KNOBS, KnobError, Knobs, add_knob_flags, knobs_from_args


def _parse(argv: list[str]) -> Knobs:
    parser = argparse.ArgumentParser()
    add_knob_flags(parser)
    return knobs_from_args(parser.parse_args(argv))


def test_defaults_round_trip_through_yaml_keys():
    knobs = Knobs(planner="eplb-window", distance=3, keep_alive_s=5.0, layer_memory_cap_gib=0.5, scaler=False)
    assert Knobs.from_mapping(knobs.to_mapping()) == knobs
    assert set(knobs.to_mapping()) == {k.key for k in KNOBS}


def test_flags_override_the_config_file(tmp_path):
    path = tmp_path / "knobs.yaml"
    path.write_text("planner: static\ndistance: 3\nkeepAliveSeconds: 7\ncvThreshold: 0.5\n")
    knobs = _parse(["--config", str(path), "--distance", "1", "--no-placer"])
    assert (knobs.planner, knobs.distance, knobs.keep_alive_s, knobs.cv_threshold, knobs.placer) == ("static", 1, 7.0, 0.5, False)


@pytest.mark.parametrize("doc, needle", [
    ({"plannr": "moeless"}, "unknown key 'plannr'"),
    ({"planner": "fastest"}, "planner: unknown planner 'fastest'"),
    ({"predictor": "oracle"}, "predictor: must be one of gate, history, off"),
    ({"keepAliveSeconds": -1}, "keepAliveSeconds: must be >= 0.0"),
    ({"distance": 0}, "distance: must be >= 1"),
    ({"distance": 1.5}, "distance: expected an integer"),
    ({"layerMemoryCapGiB": 0}, "layerMemoryCapGiB: must be > 0.0"),
    ({"scaler": "no"}, "scaler: expected true or false"),
])
def test_bad_values_name_the_key(doc, needle):
    with pytest.raises(KnobError, match=needle.replace("(", r"\(")):
        Knobs.from_mapping(doc, "policy.yaml")


def test_bad_yaml_and_missing_file_are_one_clear_line(tmp_path):
    bad = tmp_path / "bad.yaml"
    bad.write_text("planner: [unclosed\n")
    with pytest.raises(KnobError, match="bad.yaml: not valid YAML"):
        Knobs.from_yaml(bad)
    with pytest.raises(KnobError, match="cannot read the config file"):
        Knobs.from_yaml(tmp_path / "missing.yaml")


def test_memory_price_is_memory_neutral_unless_set(tmp_path):
    assert Knobs().memory_price is None and Knobs.from_mapping({"memoryPrice": None}).memory_price is None
    assert _parse(["--memory-price", "null"]).memory_price is None
    assert _parse(["--memory-price", "0.03"]).memory_price == 0.03
    with pytest.raises(KnobError, match="memoryPrice: must be >= 0.0"):
        Knobs.from_mapping({"memoryPrice": -1})


def test_negative_keep_alive_flag_names_the_flag():
    with pytest.raises(KnobError, match="--keep-alive: must be >= 0.0"):
        _parse(["--keep-alive", "-2"])


def test_distance_beyond_the_model_is_refused():
    Knobs(distance=29).check_for_model(30)
    with pytest.raises(KnobError, match="distance: 30 layers reaches past the model's 30 MoE layers"):
        Knobs(distance=30).check_for_model(30)
    Knobs(distance=30, predictor="off").check_for_model(30)  # no forecast, nothing to reach


def test_the_default_distance_is_fitted_to_a_tiny_model_and_a_chosen_one_is_not():
    default = Knobs().distance
    assert Knobs().for_model(default).distance == default - 1  # reaches past: shortened to the last layer
    assert Knobs().for_model(30).distance == default
    with pytest.raises(KnobError, match="distance: 5 layers reaches past"):
        Knobs(distance=5).for_model(5)
