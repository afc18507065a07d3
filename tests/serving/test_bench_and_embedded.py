"""`moeless bench serve` on a tiny model (real expert hosts), the embedded store cache, the CLI."""

import pytest

from moeless.cli import build_parser
from moeless.bench.serve import run_bench
from moeless.serving.config import choose_model
from moeless.model.weight_store import export_store


def test_bench_serve_measures_every_path_with_identical_outputs(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))
    result = run_bench("tiny:mixtral", hosts=2, prompts=2, prompt_tokens=16, max_tokens=3, batch=2, micro_batch_tokens=1)
    remote = ("expert_functions_local", "expert_functions_tcp", "expert_functions_nixl", "expert_functions_grpc",
              "expert_functions_local_paired")
    paths = {"in_process_1_threads", "in_process_2_threads", *remote}
    assert set(result["identical_outputs"]) == paths and result["layer_calls"] > 0
    for name in ("in_process_1_threads", *remote):
        assert result["identical_outputs"][name] and result["mismatches"][name] == 0
    for name in paths:
        assert result["tokens_per_s"][name] > 0
        for phase in ("all", "prefill", "decode"):
            assert result["moe_layer_ms"][name][phase]["median"] > 0
            assert result["ratio_to_best_in_process"][name][phase] > 0
            assert 0 < result["moe_layer_ms"][name][phase]["p10"] <= result["moe_layer_ms"][name][phase]["median"]
            assert result["ratio_to_best_in_process_p10"][name][phase] > 0
            assert result["moe_layer_ms"][name][phase]["median"] <= result["moe_layer_ms"][name][phase]["p90"]
            assert result["ratio_to_best_in_process_p90"][name][phase] > 0
    assert min(result["ratio_to_best_in_process"][n]["decode"] for n in paths if n.startswith("in_process")) == 1.0
    # each path alone generates what the paired run generated, every call timed
    assert set(result["alone_moe_layer_ms"]) == paths
    for name in ("in_process_1_threads", *remote):
        assert result["alone_generations_differing"][name] == 0
        assert result["alone_moe_layer_ms"][name]["all"]["calls"] == result["moe_layer_ms"][name]["all"]["calls"]
    assert min(result["alone_ratio_to_best_in_process"][n]["decode"] for n in paths if n.startswith("in_process")) == 1.0
    assert result["nixl"] == "measured"  # the test extra installs nixl; where it is missing the bench says why
    for transport in ("local", "tcp", "nixl", "grpc"):
        pingpong = result["pingpong"][transport]  # twin/overlap.py on this run's figures
        assert 0 < pingpong["pingpong_ms_per_layer"] and 0 <= pingpong["hidden_fraction"] <= 1
        breakdown = result["breakdown_ms_per_layer"][transport]
        assert set(breakdown) == {"gate", "scatter", "invoke", "expert_compute", "transfer_and_call", "gather"}
        assert 0 < breakdown["expert_compute"] <= breakdown["invoke"]
    run = result["pingpong_run"]  # every forward split (1 token per micro-batch is enough): generations unchanged
    assert set(run["engines"]) == {"in_process", "tcp_1", "tcp_2", "local_1", "local_2"}
    for name, engine in run["engines"].items():
        assert engine["generations_differing"] == 0
        assert engine["prefill"]["forwards"] == 3 and engine["decode"]["forwards"] == 2  # 1 + 2 prefills, 2 steps
        assert (engine["prefill"]["transfer_ms"] > 0) == (name != "in_process")
    for transport in ("tcp", "local"):  # served as `moeless serve` does: a forecast and report per micro-batch
        one, two = run["engines"][f"{transport}_1"], run["engines"][f"{transport}_2"]
        assert (one["reports"], two["reports"]) == (5, 10)
        assert one["forecast_ms_per_report"] > 0 and two["forecast_ms_per_report"] > 0
    assert set(run["effect"]) == {"tcp", "local"} and all(set(e) == {"prefill", "decode"} for e in run["effect"].values())
    assert result["latency_model"]["alpha_s_per_token"] > 0 and result["latency_model"]["transport"] == "local"
    assert result["tokens_moved_per_layer"] > 0
    pairing = result["pairing"]  # every call of the paired path checked (and paired where that paid), its cost counted
    dispatch = pairing["dispatch"]
    assert dispatch["calls"] == result["layer_calls"] and 0 <= dispatch["paired_calls"] <= dispatch["calls"]
    assert 0 < dispatch["us_per_layer_median"] <= dispatch["us_per_layer_p90"] and dispatch["relevel_s"] > 0
    assert set(pairing["ratio_to_static_local"]) == {"prefill", "decode", "all"}
    assert all(r > 0 for r in pairing["ratio_to_static_local"].values())
    wire = result["wire_per_layer_call"]  # each token once per host: fewer rows out than (token, expert) pairs
    assert 0 < wire["rows_sent"] < wire["pairs"] and 0 < wire["ratio_to_one_row_per_pair"] < 1
    for name in ("round_trip_decode", "round_trip_prefill"):
        assert set(result["round_trip_us"][name]) == {"local", "tcp", "nixl", "grpc"}
        assert all(0 < row["p50"] <= row["p90"] for row in result["round_trip_us"][name].values())


def test_export_store_is_cached_by_expert_weights(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))
    a = choose_model("tiny:mixtral")
    first = export_store(a.loader(), a.name)
    stamp = (first / "index.json").stat().st_mtime_ns
    assert export_store(a.loader(), a.name) == first and (first / "index.json").stat().st_mtime_ns == stamp
    other = choose_model("tiny:olmoe")
    assert export_store(other.loader(), other.name) != first


def test_unknown_model_argument_is_a_clear_error():
    with pytest.raises(SystemExit, match="not 'default', 'tiny:ARCH', a model directory or BASE\\+FINETUNE"):
        choose_model("/no/such/dir")


@pytest.mark.parametrize("argv", [["serve", "--help"], ["bench", "serve", "--help"]])
def test_cli_help(argv, capsys):
    with pytest.raises(SystemExit) as info:
        build_parser().parse_args(argv)
    assert info.value.code == 0 and "--model" in capsys.readouterr().out


def test_bench_load_compares_static_and_continuous_batching_on_the_same_requests(tmp_path):
    """The CLI in its own process (it starts its own Ray): JSON with both modes, same texts."""
    import json
    import os
    import subprocess
    import sys

    env = dict(os.environ, MOELESS_CACHE=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, "-m", "moeless", "bench", "load", "--model", "tiny:mixtral", "--clients", "3",
                          "--max-tokens", "4", "--prompt-tokens", "8", "--modes", "static-8,continuous",
                          "--out", str(tmp_path)], env=env, capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    doc = json.loads((tmp_path / "load.json").read_text())
    assert doc["identical_outputs"] is True and set(doc["modes"]) == {"static-8", "continuous"}
    for mode in doc["modes"].values():
        row = mode["3"]
        assert row["succeeded"] == 3 and row["completion_tokens"] == 12 and row["ttft_s"]["p99"] > 0
        assert row["identical_to_sequential"] == 3 and row["differ_from_sequential"] == []
        assert len(row["outcomes"]) == 3
    assert doc["continuous_vs_static"]["3"]["static-8"]["throughput"] > 0
    assert "continuous, N=3: vs static-8" in run.stdout


def test_bench_transport_times_every_transport_against_in_process(tmp_path, monkeypatch):
    from moeless.bench.transport import run_transport_bench

    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))
    result = run_transport_bench("tiny:mixtral", repeats=5)
    calls = result["calls"]
    assert calls["round_trip_decode"]["rows_sent"] == 16 and calls["round_trip_prefill"]["rows_back"] == 1024
    assert calls["layer_prefill"]["rows_sent"] < calls["layer_prefill"]["pairs"]  # each token once: tiny mixtral, k = 2
    for name in calls:
        assert set(result["us"][name]) == {"in_process", "routed_in_process", "local", "tcp", "nixl", "grpc",
                                           "grpc_per_expert"}
        assert all(0 < f["p50"] <= f["p90"] for f in result["us"][name].values())
        assert result["ratio_to_in_process"][name]["in_process"] == 1.0
        assert result["identical_to_in_process"][name] == {"local": True, "tcp": True, "nixl": True, "grpc": True}
    assert result["nixl"] == "measured"


def test_bench_transport_geometry_is_one_random_layer_in_its_shape_and_dtype_computed_in_it(tmp_path, monkeypatch):
    import dataclasses

    from moeless.bench.transport import random_layer_store, run_transport_bench
    from moeless.model.weight_store import WeightStore
    from moeless.twin import geometry

    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))
    small = dataclasses.replace(geometry.GEOMETRIES["mixtral-8x7b"], name="small-mixtral", hidden=64, expert_ffn=96)
    root = random_layer_store(small)
    store = WeightStore.open(root)
    assert (store.num_layers, store.num_experts, store.act, store.index["dtype"]) == (1, 8, "silu", "bfloat16")
    weights = store.load(0, 3)
    assert [tuple(weights[n].shape) for n in ("gate", "up", "down")] == [(96, 64), (96, 64), (64, 96)]
    assert 0.015 < weights["up"].float().std().item() < 0.025
    stamp = (root / "index.json").stat().st_mtime_ns
    assert random_layer_store(small) == root and (root / "index.json").stat().st_mtime_ns == stamp
    assert random_layer_store(dataclasses.replace(small, hidden=32)) != root  # same name, other sizes
    monkeypatch.setitem(geometry.GEOMETRIES, "small-mixtral", small)
    result = run_transport_bench(geometry="small-mixtral", repeats=3, compute_dtype="store")
    assert (result["model"], result["dtype"], result["hidden"]) == ("random-small-mixtral", "bfloat16", 64)
    assert result["compute_dtype"] == "store"  # the host's answers equal the in-process bfloat16 compute's:
    assert result["calls"]["round_trip_decode"]["bytes_sent"] < 16 * 64 * 4  # rows travel in bfloat16
    assert all(all(same.values()) for same in result["identical_to_in_process"].values())


def test_bench_transport_refuses_an_unknown_geometry_naming_the_known_ones(capsys):
    from moeless.cli import main

    assert main(["bench", "transport", "--geometry", "no-such-model", "--quick"]) == 2
    err = capsys.readouterr().err
    assert "unknown model 'no-such-model'" in err and "mixtral-8x7b" in err


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the error where there is no CUDA")
def test_bench_transport_on_cuda_without_cuda_is_one_clear_error(capsys):
    from moeless.bench.transport import run_transport_bench
    from moeless.cli import main
    from moeless.hardware.cuda_profile import CudaUnavailable

    assert main(["bench", "transport", "--device", "cuda", "--quick"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("moeless bench transport: --device cuda:") and "CUDA build of torch" in err
    with pytest.raises(CudaUnavailable):
        run_transport_bench("tiny:mixtral", repeats=2, device="cuda")
