"""`moeless eval --geometry`: a quick deployment run on an HF config.json and an imported routing
file writes the report with its models named; a routing file of another geometry is one error line."""

from __future__ import annotations

import csv
import json

import pytest

from moeless.cli import main
from moeless.evaluation.frontier import frontier_points

CONFIG = {"model_type": "mixtral", "num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 128, "num_local_experts": 4,
          "num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 1000,
          "torch_dtype": "bfloat16", "tie_word_embeddings": False}


@pytest.fixture(scope="module")
def inputs(tmp_path_factory):
    root = tmp_path_factory.mktemp("deploy")
    (root / "config.json").write_text(json.dumps(CONFIG))
    records = [{"req_id": r, "token_idx": t, "layer": l, "topk_ids": [(t * r + l) % 4, (t * r + l + 1) % 4]}
               for r in range(3) for t in range(20) for l in range(2)]
    (root / "log.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    assert main(["trace", "import", str(root / "log.jsonl"), "--out", str(root / "routing.npz")]) == 0
    return root


def test_a_quick_deployment_run_writes_the_report(inputs, tmp_path):
    out = tmp_path / "run"
    argv = ["eval", "--quick", "--geometry", str(inputs / "config.json"), "--gpu", "H100x2", "--routing", str(inputs / "routing.npz"),
            "--workload", "code=generated:humaneval", "--max-batched-tokens", "512", "--load", "0.5", "--out", str(out),
            "--markdown", str(tmp_path / "deployments.md")]
    assert main(argv) == 0
    md = (tmp_path / "deployments.md").read_text()
    for says in ("Execution model: serial", "billing: resident", "roofline estimate (not measured)", "recorded routing from log.jsonl",
                 "static EP (Megatron-LM)", "moeless, perfect forecast", "bound", "never slower", "(run/gain-by-batch-tokens.png)"):
        assert says in md, says
    assert "decode step s replays its logged request's token s" in md and "Moefied routing is a stand-in" not in md
    report = json.loads((out / "report.json").read_text())
    assert {r["case"] for r in report["rows"]} >= {"static", "eplb-window", "paper", "moeless-history", "moeless-perfect"}
    assert all(r["mean_ms"] >= r["bound_ms"] - 1e-9 for r in report["rows"])  # the bound holds in the report too
    assert (out / "gain-by-batch-tokens.png").stat().st_size > 0 and (out / "deployments.csv").is_file()
    assert main(["report", str(out)]) == 0 and (out / "report.md").read_text() == md.replace("](run/", "](")
    # The frontier: every point of the cell in the table, the CSV and the figure, for both phases run.
    keys = {key for key, *_ in frontier_points(4, 2)} | {"offline", "hindsight", "bound"}
    cell = json.loads((out / "run.json").read_text())["cells"][0]
    assert set(cell["frontier"]) == keys
    rows = list(csv.DictReader((out / "frontier.csv").open()))
    phases = {r["phase"] for r in rows}
    assert phases and {(r["point"], r["phase"]) for r in rows} == {(k, p) for k in keys for p in phases}
    assert "## The frontier: MoE-layer time against expert GB·s" in md and "full replication" in md and "moeless-sets, price x0.1" in md
    assert "| hindsight homes |" in md
    assert (out / "frontier.png").stat().st_size > 0


def test_frontier_points_name_what_production_eplb_really_holds():
    """E + N rounded up to fill every GPU: on 32 GPUs E/8 = 8 and E/4 = 16 of 64 both hold 32 more."""
    eplb = [label for _, label, planner, _ in frontier_points(64, 32) if planner == "eplb-production"]
    assert eplb == ["production EPLB, N = 0", "production EPLB, N = 32"]
    eplb = [label for _, label, planner, _ in frontier_points(64, 8) if planner == "eplb-production"]
    assert eplb == ["production EPLB, N = 0", "production EPLB, N = 8", "production EPLB, N = 16"]
    prices = [label for _, label, planner, _ in frontier_points(64, 8) if planner == "moeless-sets"]
    assert prices == ["moeless-sets, price x0", "moeless-sets, price x0.1", "moeless-sets, price x1", "moeless-sets, price x10"]


def test_a_routing_file_of_another_geometry_is_one_error_line(inputs, tmp_path, capsys):
    argv = ["eval", "--geometry", "mixtral-8x7b", "--routing", str(inputs / "routing.npz"), "--out", str(tmp_path / "x")]
    assert main(argv) == 2
    err = capsys.readouterr().err.strip()
    assert "E=4, k=2, but mixtral-8x7b has E=8, k=2" in err and len(err.splitlines()) == 1
