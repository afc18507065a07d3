"""`moeless eval --quick` end to end (tiny model, a measured cost profile, a real-format trace file),
`moeless report` re-rendering it byte for byte, and bad input answered with one line and exit code 2."""

from __future__ import annotations

import csv
import hashlib
import json
import shutil
import subprocess
import sys

import numpy as np
import pytest

from moeless.cli import main
from moeless.evaluation.runs import CV_THRESHOLDS

ROWS = 30


def azure_trace(path, rows: int = ROWS):
    """A trace in the Azure format: bursty arrivals over ~6 s, output lengths 1..40."""
    rng = np.random.default_rng(7)
    stamps = np.cumsum(rng.exponential(0.2, rows))
    lines = ["TIMESTAMP,ContextTokens,GeneratedTokens"]
    for s in stamps:
        lines.append(f"2023-11-16 18:{15 + int(s) // 60:02d}:{int(s) % 60:02d}.{int((s % 1) * 1e7):07d},"
                     f"{rng.integers(10, 2000)},{rng.integers(1, 40)}")
    path.write_text("\n".join(lines) + "\n")
    return path


@pytest.fixture(scope="module")
def run_dir(tmp_path_factory):
    root = tmp_path_factory.mktemp("eval")
    trace = azure_trace(root / "chat.csv")
    out = root / "run"
    code = main(["eval", "--quick", "--workload", f"chat={trace}:sharegpt", "--requests", str(ROWS), "--out", str(out),
                 "--markdown", str(root / "docs" / "evaluation.md"), "--memory-price", "0.5"])
    assert code == 0
    return out


def digest(folder) -> dict[str, str]:
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.rglob("*")) if p.is_file()}


def test_a_quick_run_writes_every_table_and_plot_with_its_models_named(run_dir):
    doc = json.loads((run_dir / "run.json").read_text())
    assert doc["knobs"]["memoryPrice"] == doc["planner"]["gb_s_price"] == 0.5  # the knob prices the plans
    w = doc["workloads"][0]
    assert w["requests"] == ROWS and "chat.csv" in w["arrivals"]
    assert set(w["batchings"]) == {"continuous", "per-second"}
    cont = w["batchings"]["continuous"]
    groups = [c["group"] for c in cont["cases"]]
    assert groups.count("ablation") == 8 and groups.count("cv") == len(CV_THRESHOLDS[::2]) and groups.count("distance") == 1
    assert {c["planner"] for c in cont["cases"] if c["group"] == "main"} >= {"moeless", "static", "eplb-window", "oracle", "paper"}
    assert all(c["group"] == "main" for c in w["batchings"]["per-second"]["cases"])  # ablations and sweeps: first batching only
    report = (run_dir / "report.md").read_text()
    for words in ("serial execution", "paper execution", "`resident` billing", "`per-layer` billing", "exposed cold starts",
                  "gate replicas, d=1", "history window", "Against the paper's claims", "-43%", "-22%", "-84%",
                  "prediction distance sweep", "CV threshold sweep", "ablations", "static EP (Megatron-LM)", "Oracle (lossy bound)"):
        assert words in report, words
    shown = report.count("](plots/")
    plots = sorted((run_dir / "plots").glob("*.png"))
    assert shown == len(plots) == 10 and all(p.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" for p in plots)
    tables = json.loads((run_dir / "report.json").read_text())["tables"]
    for table in tables:
        with open(run_dir / "tables" / f"{table['name']}.csv") as f:
            rows = list(csv.reader(f))
        assert rows[0] == table["columns"] and len(rows) == len(table["rows"]) + 1
    claims = next(t for t in tables if t["name"] == "claims")
    assert {(r[4], r[6]) for r in claims["rows"] if "time" in r[1]} == {(e, c) for e in ("serial", "paper") for c in ("with", "without")}


def test_static_ep_in_the_report_pays_all_experts_memory_for_the_whole_run(run_dir):
    doc = json.loads((run_dir / "run.json").read_text())
    static = next(c for c in doc["workloads"][0]["batchings"]["continuous"]["cases"] if c["planner"] == "static")["figures"]["all"]
    m = doc["model"]
    expected = m["layers"] * m["experts"] * doc["cluster"]["expert_bytes"] / 1e9 * static["seconds"]
    assert static["gb_s_expert_resident"] == pytest.approx(expected)


def test_rerendering_a_run_directory_gives_the_same_bytes(run_dir, tmp_path):
    """`moeless report` on a copy of the run directory holding only run.json writes, byte for byte,
    the report `moeless eval` wrote: the report is a function of run.json alone."""
    copy = tmp_path / "copy"
    copy.mkdir()
    shutil.copy(run_dir / "run.json", copy / "run.json")
    assert main(["report", str(copy)]) == 0
    assert digest(copy) == {k: v for k, v in digest(run_dir).items() if k != "cost-profile.json"}


def test_the_markdown_copy_links_to_the_run_directorys_plots(run_dir):
    md = (run_dir.parent / "docs" / "evaluation.md").read_text()
    links = [line.split("](", 1)[1].rstrip(")") for line in md.splitlines() if line.startswith("![")]
    assert links and all(link.startswith("../run/plots/") for link in links)
    assert all((run_dir.parent / "docs" / link).is_file() for link in links)


def one_error_line(capsys, argv: list[str]) -> str:
    code = main(argv)
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1, err
    return err[0]


def test_a_trace_with_a_bad_row_is_one_error_line(tmp_path, capsys):
    trace = azure_trace(tmp_path / "t.csv", 5)
    trace.write_text(trace.read_text() + "2023-11-16 18:20:00.0,12\n")
    line = one_error_line(capsys, ["eval", "--quick", "--workload", f"bad={trace}", "--out", str(tmp_path / "o")])
    assert line.startswith("moeless eval: ") and f"{trace}:7: bad row" in line and "expected 3 fields" in line
    assert not (tmp_path / "o").exists()


def test_an_unknown_planner_is_one_error_line(tmp_path, capsys):
    line = one_error_line(capsys, ["eval", "--quick", "--planner", "fastest", "--out", str(tmp_path / "o")])
    assert "unknown planner 'fastest'" in line and "moeless" in line


def test_a_profile_missing_alpha_is_one_error_line(tmp_path, capsys):
    profile = {"beta": 1e-9, "call_overhead": 1e-5, "load_s": {"disk": 1e-3, "host": 1e-4}, "expert_bytes": 100,
               "non_expert_bytes": 1000, "source": "hand-made"}
    (tmp_path / "p.json").write_text(json.dumps(profile))
    line = one_error_line(capsys, ["eval", "--quick", "--profile", str(tmp_path / "p.json"), "--out", str(tmp_path / "o")])
    assert "lacks 'alpha'" in line and "moeless bench planner" in line


@pytest.mark.parametrize("argv, says", [
    (["eval", "--quick", "--planner", "static", "--ablate", "scaler"], "need planner moeless or paper"),
    (["eval", "--quick", "--ablate", "gate"], "unknown part 'gate'"),
    (["eval", "--quick", "--workload", "x=generated:poems"], "unknown prompts 'poems'"),
    (["eval", "--quick", "--requests", "0"], "--requests must be positive"),
    (["eval", "--quick", "--keep-alive", "-1"], "must be >= 0"),
    (["report", "/nonexistent/run"], "no run.json"),
])
def test_other_bad_input_is_one_error_line_too(tmp_path, capsys, argv, says):
    assert says in one_error_line(capsys, [*argv, *(["--out", str(tmp_path / "o")] if argv[0] == "eval" else [])])


def test_the_command_line_exits_2_with_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "moeless", "eval", "--quick", "--planner", "nope", "--out", str(tmp_path)],
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and len(proc.stderr.strip().splitlines()) == 1, proc.stderr
