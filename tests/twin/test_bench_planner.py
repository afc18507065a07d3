"""Iterations from arrivals, the replay/summary of `moeless bench planner`, and the command end to end."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pytest

from moeless.twin.arrivals import AZURE_CONV_RATE, arrival_times
from moeless.twin.iterations import compose_iterations


@dataclass
class FakeRequest:
    prefill: np.ndarray
    decode: np.ndarray


def request(prompt: int, steps: int, expert: int) -> FakeRequest:
    """A 1-layer, 4-expert request: its prompt goes to `expert`, each decode token too."""
    prefill = np.zeros((1, 4), dtype=np.int64)
    prefill[0, expert] = prompt
    decode = np.zeros((steps, 1, 4), dtype=np.int64)
    decode[:, 0, expert] = 1
    return FakeRequest(prefill, decode)


def test_continuous_batching_prefills_newcomers_then_decodes_everyone_running():
    reqs = [request(10, 2, 0), request(20, 3, 1)]
    its = compose_iterations(reqs, np.array([0.0, 0.15]), step_s=0.1, max_batch=8, max_iterations=100)
    assert [i.phase for i in its] == ["prefill", "decode", "prefill", "decode", "decode", "decode"]
    assert its[0].load.tolist() == [[10, 0, 0, 0]] and its[2].load.tolist() == [[0, 20, 0, 0]]
    assert its[3].load.tolist() == [[1, 1, 0, 0]] and its[3].batch == 2
    assert its[5].load.tolist() == [[0, 1, 0, 0]]
    # Every token of every request is in exactly one iteration.
    assert sum(i.load.sum() for i in its) == 10 + 2 + 20 + 3


def test_max_batch_holds_newcomers_back_and_idle_time_jumps_to_the_next_arrival():
    reqs = [request(5, 2, e) for e in range(3)]
    its = compose_iterations(reqs, np.array([0.0, 0.0, 100.0]), step_s=0.1, max_batch=1, max_iterations=100)
    assert [i.batch for i in its if i.phase == "prefill"] == [1, 1, 1]
    assert len(its) == 9


def test_arrivals_from_the_azure_trace_or_poisson_fallback(tmp_path: Path):
    trace = tmp_path / "conv.csv"
    trace.write_text("TIMESTAMP,ContextTokens,GeneratedTokens\n2023-11-16 18:15:46.5000000,1,1\n2023-11-16 18:15:48.0000000,1,1\n")
    seconds, note = arrival_times(2, trace)
    assert seconds.tolist() == pytest.approx([0.0, 1.5]) and "Azure" in note
    seconds, _ = arrival_times(2, trace, rate_scale=3.0)
    assert seconds.tolist() == pytest.approx([0.0, 0.5])
    seconds, note = arrival_times(2000, tmp_path / "missing.csv")
    assert "Poisson" in note and "not found" in note
    assert np.diff(seconds).mean() == pytest.approx(1 / AZURE_CONV_RATE, rel=0.1)
    with pytest.raises(ValueError, match="at least one request"):
        arrival_times(0)


@pytest.mark.filterwarnings("ignore")
def test_bench_planner_command_end_to_end(tmp_path: Path, capsys):
    from moeless.cli import main

    args = ["bench", "planner", "--quick", "--timing-repeats", "3", "--requests", "2", "--new-tokens", "2",
            "--iterations", "12", "--out", str(tmp_path)]
    assert main(args) == 0
    printed = capsys.readouterr().out
    assert "alpha" in printed and "EPLB/moeless" in printed and "prefetch distance d = 1" in printed and "targets" in printed
    doc = json.loads((tmp_path / "planner.json").read_text())
    assert [(r["E"], r["G"]) for r in doc["planning_time"]] == [(8, 8), (16, 8), (64, 8), (256, 64)]
    assert doc["cost_profile"]["alpha"] > 0 and doc["cost_profile"]["load_s"]["disk"] > doc["cost_profile"]["load_s"]["host"] > 0
    summary = doc["quality"]["summary"]
    assert {"static|perfect|d=1", "moeless|predictor|d=1", "eplb-window|previous|d=1", "moeless|perfect|d=1"} <= set(summary)
    assert summary["static|perfect|d=1"]["all"]["serial_cold_s_vs_static"] == pytest.approx(1.0)
    profile = json.loads((tmp_path / "cost-profile.json").read_text())
    assert profile["alpha"] == doc["cost_profile"]["alpha"]


def test_loads_from_a_saved_trace_file(tmp_path: Path):
    from moeless.traces.request_loads import RequestLoads, save_request_loads
    from moeless.traces.sources import requests_from

    saved = [RequestLoads(np.full((2, 4), i), np.ones((i, 2, 4), dtype=np.int64), prompt_tokens=4) for i in range(3)]
    path = save_request_loads(tmp_path / "t.npz", saved)
    loads, forecasts, facts, note = requests_from(str(path), requests=3, new_tokens=0, distances=[1])
    assert [len(r.decode) for r in loads] == [0, 1, 2] and loads[2].prefill.tolist() == [[2] * 4] * 2
    assert forecasts is None and str(path) in note and facts.hidden > 0
    with pytest.raises(ValueError, match="requests > 0"):
        requests_from(str(path), requests=0, new_tokens=0, distances=[1])


PROFILE = {"alpha": 7.5e-6, "beta": 2.9e-6, "call_overhead": 8.7e-5, "load_s": {"disk": 1.2e-3, "host": 1e-4},
           "expert_bytes": 1_327_104, "non_expert_bytes": 10**8, "relevel_s": 2e-5, "source": "a test"}


def test_plan_command_prints_every_layer_and_gpu(tmp_path: Path, capsys):
    from moeless.cli import main

    path, profile = tmp_path / "loads.npy", tmp_path / "profile.json"
    np.save(path, np.array([[100, 20, 0, 5], [1, 1, 1, 1]]))
    profile.write_text(json.dumps(PROFILE))
    assert main(["plan", str(path), "--gpus", "2", "--planner", "paper", "--profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "layer 0:" in out and "layer 1:" in out and out.count("  gpu 1:") == 2 and "serial" in out
    profile.write_text(json.dumps({k: v for k, v in PROFILE.items() if k != "alpha"}))
    assert main(["plan", str(path), "--profile", str(profile)]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "lacks 'alpha'" in err[0] and str(profile) in err[0]


def test_plan_says_why_it_chose_each_copy(tmp_path: Path, capsys):
    """Samples [B, L, E] for moeless-sets: a hot expert in each half of the batches gets a copy on
    the other GPU, and the output says what each copy saves against its price."""
    from moeless.cli import main

    path, profile = tmp_path / "samples.npy", tmp_path / "profile.json"
    np.save(path, np.array([[[400, 20, 20, 20]], [[20, 20, 400, 20]]]))
    profile.write_text(json.dumps(PROFILE))
    assert main(["plan", str(path), "--gpus", "2", "--planner", "moeless-sets", "--profile", str(profile)]) == 0
    out = capsys.readouterr().out
    assert "copy of expert 0 on gpu 1: saves" in out and "copy of expert 2 on gpu 0: saves" in out and "against its price" in out
    assert main(["plan", str(path), "--gpus", "2", "--planner", "static", "--profile", str(profile)]) == 0
    assert "no copies: every token at its expert's home" in capsys.readouterr().out


def test_plan_with_the_gates_batches_says_which_homes_moeless_moved_and_why(tmp_path: Path, capsys):
    """Batches [B, L, E] for moeless: what its gates reported, a plan after each. Experts 0 and 1 hot
    in GPU 0's static block: after 3 batches it moves two homes, and says so with the layer times."""
    from moeless.cli import main

    path, profile = tmp_path / "batches.npy", tmp_path / "profile.json"
    np.save(path, np.array([[[400, 400, 20, 20]]] * 5))
    profile.write_text(json.dumps(PROFILE))
    args = ["plan", str(path), "--gpus", "2", "--profile", str(profile), "--memory-price", "1e9"]
    assert main([*args, "--move-after", "3"]) == 0
    out = capsys.readouterr().out
    assert "layer 0: 2 experts' homes moved at plan 4" in out and " us -> " in out
    assert sorted(out.split("  gpu 0: ")[1].split("\n")[0].split()) != ["0:1.00", "1:1.00"]  # the hot pair split
    assert main([*args, "--move-after", "10"]) == 0
    assert "homes: static EP's blocks (no move paid by 1% after 5 plans)" in capsys.readouterr().out
    assert main([*args, "--move-after", "3", "--move-every", "0"]) == 0
    assert "homes: static EP's blocks (moves off: homeMovesEvery 0)" in capsys.readouterr().out
    for bad in (["--move-after", "0"], ["--move-every", "-1"]):
        assert main([*args, *bad]) == 2
        err = capsys.readouterr().err
        assert err.startswith("moeless plan: --move-after must be 1 or more and --move-every 0 or more") and err.count("\n") == 1
