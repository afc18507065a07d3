"""`moeless eval --shared-pool`: a quick run writes the report (every way at every level, the
targets with their numbers) and re-renders to the same bytes; bad levels are one error line."""

from __future__ import annotations

import json

from moeless.cli import main


def test_a_quick_shared_pool_run_writes_the_report(tmp_path):
    out = tmp_path / "run"
    argv = ["eval", "--shared-pool", "--quick", "--geometry", "mixtral-8x7b", "phi-3.5-moe", "--levels", "0.2", "20",
            "--out", str(out), "--markdown", str(tmp_path / "shared-pool.md")]
    assert main(argv) == 0
    md = (tmp_path / "shared-pool.md").read_text()
    for says in ("moeless eval --shared-pool", "mixtral-8x7b", "phi-3.5-moe", "uniform (every expert alike)",
                 "whole-model GPU-s", "expert-grain GPU-s", "(run/gpu-seconds.png)", "## The targets",
                 "p99 MoE ms per step outside wake-ups", "p99 per step <= 1.1x dedicated",
                 "meeting on the pool's GPUs"):
        assert says in md, says
    run = json.loads((out / "run.json").read_text())
    assert [lv["requests_per_minute"] for lv in run["levels"]] == [0.2, 20.0]
    quiet, busy = run["levels"]
    assert sum(m["requests"] for m in quiet["models"]) < sum(m["requests"] for m in busy["models"])
    for level in run["levels"]:
        gpu_s = level["gpu_s"]
        assert gpu_s["expert-grain"] <= gpu_s["whole-model"] + 1e-9 <= gpu_s["dedicated"] + 1e-9
    assert quiet["gpu_s"]["expert-grain"] < busy["gpu_s"]["expert-grain"]  # an idle model holds nothing
    assert (out / "gpu-seconds.png").stat().st_size > 0 and (out / "shared-pool.csv").is_file()
    assert main(["report", str(out)]) == 0 and (out / "report.md").read_text() == md.replace("](run/", "](")


def test_a_level_above_the_trace_or_below_zero_is_one_error_line(tmp_path, capsys):
    for level, says in (("0", "must be positive"), ("100000", "thinning cannot add requests")):
        assert main(["eval", "--shared-pool", "--quick", "--levels", level, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
