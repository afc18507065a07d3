"""`moeless bench serve` on a tiny model (real expert hosts), the embedded store cache, the CLI."""

import pytest

from moeless.cli import build_parser
from moeless.serving.bench import run_bench
from moeless.serving.embedded import choose_model, export_store


def test_bench_serve_measures_every_path_with_identical_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))
    result = run_bench("tiny:mixtral", hosts=2, prompts=2, prompt_tokens=16, max_tokens=3, batch=2)
    paths = {"in_process_1_threads", "in_process_2_threads", "expert_functions_local", "expert_functions_grpc"}
    assert set(result["identical_outputs"]) == paths and all(result["identical_outputs"].values())
    for name in paths:
        assert result["tokens_per_s"][name] > 0
        for phase in ("all", "prefill", "decode"):
            assert result["moe_layer_ms"][name][phase]["median"] > 0
            assert result["ratio_to_best_in_process"][name][phase] > 0
    assert min(result["ratio_to_best_in_process"][n]["decode"] for n in paths if n.startswith("in_process")) == 1.0
    for transport in ("local", "grpc"):
        breakdown = result["breakdown_ms_per_layer"][transport]
        assert set(breakdown) == {"gate", "scatter", "invoke", "expert_compute", "transfer_and_call", "gather"}
        assert 0 < breakdown["expert_compute"] <= breakdown["invoke"]
    assert result["latency_model"]["alpha_s_per_token"] > 0 and result["latency_model"]["transport"] == "local"
    assert result["tokens_moved_per_layer"] > 0


def test_export_store_is_cached_by_expert_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))
    a = choose_model("tiny:mixtral")
    first = export_store(a.loader(), a.name)
    stamp = (first / "index.json").stat().st_mtime_ns
    assert export_store(a.loader(), a.name) == first and (first / "index.json").stat().st_mtime_ns == stamp
    other = choose_model("tiny:olmoe")
    assert export_store(other.loader(), other.name) != first


def test_unknown_model_argument_is_a_clear_error():
    with pytest.raises(SystemExit, match="not 'default', 'tiny:ARCH' or a model directory"):
        choose_model("/no/such/dir")


@pytest.mark.parametrize("argv", [["serve", "--help"], ["bench", "serve", "--help"]])
def test_cli_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 0 and "--model" in capsys.readouterr().out
