"""`moeless bench expert-invoke` end to end on a tiny shape: round trips and each tier's load time."""

from __future__ import annotations

import json


def test_invoke_bench_reports_every_tier_beside_the_compute(tmp_path, capsys):
    from moeless.cli import main

    assert main(["bench", "expert-invoke", "--quick", "--hidden", "32", "--ffn", "16", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "disk -> host" in printed and "reload after eviction" in printed and "compute of one call" in printed
    doc = json.loads((tmp_path / "expert-invoke.json").read_text())
    tiers = doc["tiers"]
    assert set(tiers) == {"disk_to_host_s", "host_to_device_s", "cold_no_tier_s", "grpc_disk_s", "grpc_host_s"}
    assert all(v > 0 for v in tiers.values())
    assert [r["tokens_per_expert"] for r in doc["rows"]] == [1, 64, 512] and all(r["host_compute_ms"] > 0 for r in doc["rows"])
