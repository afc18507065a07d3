"""`moeless bench live --quick --mirror` end to end: the real stack (Ray Serve, expert-host
processes, the planning loop) on the tiny model, static EP and moeless on the same requests, each
run twice (in order, then reversed)."""

import json
import math
import subprocess
import sys


def test_bench_live_quick_mirrored_replays_every_run_with_the_same_texts(tmp_path):
    run = subprocess.run([sys.executable, "-m", "moeless", "bench", "live", "--quick", "--mirror", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=400)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "live.json").read_text())
    assert result["order"] == ["static", "moeless", "moeless~2", "static~2"]
    assert set(result["configs"]) == set(result["order"])
    for name, config in result["configs"].items():
        assert config["failed"] == 0 and config["succeeded"] == result["requests"] == 8, (name, config["errors"])
        for phase in ("prefill", "decode"):
            p = config["phases"][phase]
            assert p["critical_path_s"] > 0 and math.isfinite(p["model_online_error"]), (name, phase)
        assert config["latency_fit_end"]["calls"] > 0  # the loop refitted the latency model on what it served
    assert result["identical_to_static"] == {key: 8 for key in result["order"]}
    assert set(result["ratios"]) == {"static", "moeless"}  # the two runs of each pooled
    assert result["ratios"]["static"] == {"prefill": 1.0, "decode": 1.0}
    assert all(r > 0 for r in result["ratios"]["moeless"].values())
    assert "critical path / static EP's (means of two runs each)" in run.stdout
