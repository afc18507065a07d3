"""`moeless bench live --quick` end to end: the real stack (Ray Serve, expert-host processes, the
planning loop) on the tiny model, static EP and moeless on the same requests."""

import json
import subprocess
import sys


def test_bench_live_quick_replays_both_configurations_with_the_same_texts(tmp_path):
    run = subprocess.run([sys.executable, "-m", "moeless", "bench", "live", "--quick", "--out", str(tmp_path)],
                         capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "live.json").read_text())
    assert set(result["configs"]) == {"static", "moeless"}
    for name, config in result["configs"].items():
        assert config["failed"] == 0 and config["succeeded"] == result["requests"] == 8, (name, config["errors"])
        assert config["phases"]["prefill"]["critical_path_s"] > 0 and config["phases"]["decode"]["critical_path_s"] > 0
    assert result["identical_to_static"] == {"static": 8, "moeless": 8}
    assert result["ratios"]["static"] == {"prefill": 1.0, "decode": 1.0}
    assert all(r > 0 for r in result["ratios"]["moeless"].values())
    assert "critical path / static EP's" in run.stdout
