"""The model benchmarks' pure parts and the model commands' usage errors (no model is built)."""

from __future__ import annotations

import pytest
import torch

from moeless.cli import main
from moeless.bench.model import candidate_name, idle_in_decode, parse_candidate
from moeless.model.default import BuildConfig, expert_shape
from moeless.model.shape import DEFAULT_EXPERT_SHAPE


def test_candidates_parse_to_build_configs_and_back():
    cfg = parse_candidate("e16-sh768-k8")
    assert (cfg.num_experts, cfg.shared_neurons, cfg.top_k, cfg.expert_ffn) == (16, 768, 8, 48)
    assert candidate_name(cfg) == "e16-sh768-k8" and cfg == BuildConfig()
    assert candidate_name(parse_candidate(" e8-sh0-k4 ")) == "e8-sh0-k4"
    with pytest.raises(ValueError, match="not like e16-sh768-k8"):
        parse_candidate("e16-k8")
    with pytest.raises(ValueError, match="do not split into 10 equal experts"):
        parse_candidate("e10-sh768-k2")
    with pytest.raises(ValueError, match="top_k must be in 1..16"):
        parse_candidate("e16-sh768-k17")


def test_expert_shape_follows_the_config():
    assert expert_shape() == DEFAULT_EXPERT_SHAPE == (576, 48)
    assert expert_shape(BuildConfig(num_experts=8, top_k=4, shared_neurons=0)) == (576, 192)
    assert expert_shape(BuildConfig(num_experts=32, top_k=16, shared_neurons=1024)) == (576, 16)


def test_idle_in_decode_counts_experts_without_tokens_per_layer():
    # Two decode iterations, two layers, four experts.
    loads = torch.tensor([[[2, 0, 0, 1], [1, 1, 1, 0]], [[0, 0, 3, 0], [1, 1, 1, 0]]])
    assert idle_in_decode(loads).tolist() == [2.5, 1.0]


@pytest.mark.parametrize(
    "argv, message",
    [
        (["bench", "model-quality", "--candidates", "e16-k8"], "--candidates: candidate 'e16-k8' is not like e16-sh768-k8"),
        (["bench", "model-quality", "--candidates", ","], "--candidates: give at least one shape"),
        (["model", "build", "--experts", "10"], "768 routed neurons (1536 - 768 shared) do not split into 10 equal experts"),
        (["model", "info", "--top-k", "0"], "top_k must be in 1..16"),
    ],
)
def test_bad_model_flags_are_one_line_usage_errors(argv, message, capsys):
    with pytest.raises(SystemExit) as exit_:
        main(argv)
    assert exit_.value.code == 2
    err = capsys.readouterr().err
    assert message in err and len(err.strip().splitlines()) == 1
