"""`moeless bench step-scaler --quick` end to end: the real stack (Ray Serve, expert-host processes, the
planning loop with a step scaler) on the tiny model; every round widened (warm ones switched to the
loop's standby placement at once, cold ones held), reported apart against the same run's whole-model load, every answer the in-process model's."""

import json
import subprocess
import sys


def test_bench_step_scaler_quick_widens_every_round_and_answers_exactly(tmp_path):
    run = subprocess.run([sys.executable, "-m", "moeless", "bench", "step-scaler", "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "step-scaler.json").read_text())
    assert result["rounds"] == 3 and [r["kind"] for r in result["rounds_detail"]] == ["warm", "cold", "warm"]
    for row in result["rounds_detail"]:  # each round widened: held, or switched at once where warm
        assert row["failed"] == 0 and len(row["holds_s"]) + len(row["switches_s"]) >= 1, row
        assert len(row["loop_settle_s"]) >= 1, row
    assert result["gate"]["timeouts"] == 0 and result["gate"]["granted"] == result["hosts"] == 3
    # cold: the loop saw the spares emptied, so nothing on standby and the round's first newcomers held (a
    # later ask of the burst may find that widening's placement on standby); warm: switched at once
    assert all(row["holds_s"] for row in result["rounds_detail"] if row["kind"] == "cold")
    assert result["kinds"]["warm"]["switches"] >= 1 and result["kinds"]["warm"]["switch_s"]["max"] < 0.1
    assert result["whole_model_load_s"] > 0 and result["kinds"]["cold"]["hold_p99_over_whole_load"] > 0
    assert result["identical"] == result["answers"] == 18
    assert "p99 wait / whole-model load" in run.stdout and "republished the placement" in run.stdout
    assert 0 <= result["widenings_warm"] <= result["widenings_settled"] and result["widenings_settled"] >= 3
    # the cold round's widening loads the spares' part in widen itself (no planning pass): timed
    assert result["widenings_cold"] >= 1 and len(result["cold_load_s"]) == result["widenings_cold"]
    assert result["widenings_warm"] + result["widenings_cold"] <= result["widenings_settled"]
    assert "loaded what they lacked of it first" in run.stdout
