"""`moeless bench peer-copy --quick` end to end: two expert-host processes over the tiny model's store,
host 1 loading from its store, its host tier and host 0; every copied replica computing exactly."""

from __future__ import annotations

import json

from moeless.model.tiny import tiny_model


def test_peer_copy_bench_times_every_way_and_checks_the_copies(tmp_path, capsys, monkeypatch):
    from moeless.cli import main

    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path / "cache"))
    assert main(["bench", "peer-copy", "--quick", "--layers", "2", "--out", str(tmp_path)]) == 0
    printed = capsys.readouterr().out
    assert "a peer host holding them" in printed and "copies compute exactly: yes" in printed
    doc = json.loads((tmp_path / "peer-copy.json").read_text())
    experts = tiny_model("mixtral", 0).spec.num_experts
    assert doc["copies_exact"] is True and doc["layers"] == 2 and doc["experts"] == 2 * experts
    assert set(doc["seconds"]) == {"store", "tier", "peer", "measured"}
    assert all(len(t) == 1 and t[0] > 0 for t in doc["seconds"].values())
    (chose,) = doc["measured_chose"]  # a host left to choose took each expert from one way or the other
    assert chose["peer"] + chose["store"] == doc["experts"] and chose["peer"] >= 1 and chose["peer_gb_per_s"] > 0
    assert doc["peer_over_store"] > 0 and doc["peer_over_tier"] > 0
