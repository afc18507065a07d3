"""The benchmark pipeline end to end on a tiny model, and the command line's help."""

import json
import math

import pytest

from moeless.bench.common import write_result
from moeless.cli import build_parser
from moeless.bench.predictor import METHODS, BenchConfig, bench_pairs, run_bench
from moeless.predictor.report import bench_summary, plot_scores


def test_bench_scores_every_method_and_writes_json_and_png(sliced, sliced_traces, tmp_path):
    cfg = BenchConfig(distances=(1,), epochs=3, mlp_epochs=2, mlp_width=32)
    humaneval = sliced_traces.split("test")  # stands in for the second dataset
    result = run_bench(sliced, sliced_traces, humaneval, cfg, progress=False)
    for dataset in ("sharegpt", "humaneval"):
        assert set(result["scores"][dataset]) == set(METHODS)
        for method in METHODS:
            row = result["scores"][dataset][method]["1"]
            assert 0.0 <= row["load_acc"] <= 1.0
            assert math.isnan(row["topk_hit"]) == (method in ("history", "fmoe"))
    ratio = result["ratios"]["sharegpt"]["gate_reuse"]["1"]["load_acc"]
    scores = result["scores"]["sharegpt"]
    assert ratio == pytest.approx(scores["gate_replica"]["1"]["load_acc"] / scores["gate_reuse"]["1"]["load_acc"])
    assert result["memory_per_layer_bytes"]["gate_replica"] == result["gate_bytes"]
    assert all(ms > 0 for ms in result["latency_ms_per_layer"].values())
    assert "gate_replica" in bench_summary(result)
    path = write_result(str(tmp_path), "predictor", result)
    assert json.loads(path.read_text())["pairs"] == 1
    assert plot_scores(result, tmp_path / "predictor.png").stat().st_size > 1000


def test_bench_pairs_skip_targets_past_the_last_layer():
    assert bench_pairs(4, BenchConfig(distances=(1, 3), source_stride=2)) == [(0, 1), (2, 1), (0, 3)]
    with pytest.raises(ValueError, match="at least 1"):
        bench_pairs(4, BenchConfig(distances=(0,)))


@pytest.mark.parametrize("argv", [["predictor", "train", "--help"], ["predictor", "eval", "--help"], ["bench", "predictor", "--help"]])
def test_commands_have_help(argv, capsys):
    with pytest.raises(SystemExit) as exit_:
        build_parser().parse_args(argv)
    assert exit_.value.code == 0
    assert "--" in capsys.readouterr().out
