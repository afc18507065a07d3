"""`moeless bench peer-copy --quick` end to end: two expert-host processes over the tiny model's store,
host 1 loading from its store, its host tier and host 0 (over NIXL, and a host without NIXL over gRPC); every
copied replica computing exactly."""

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
    assert set(doc["seconds_per_expert"]) == {"store", "tier", "peer", "region", "grpc", "measured"}
    assert doc["differing"] == {way: [0] for way in ("store", "peer", "region", "grpc", "measured")}  # none computes other bits
    assert doc["linked_per_round"] == doc["experts"] - 1  # the peer row's, over NIXL once its link is open
    assert len(doc["link_open_s"]) == 2 and all(0 < s < 30 for s in doc["link_open_s"])  # the peer row's, the region's
    assert all(len(t) == 1 and t[0] > 0 for t in doc["seconds_per_expert"].values())
    (chose,) = doc["measured_chose"]  # a host left to choose took each expert from one way or the other
    # (its store read while its NIXL link opened: the measured choice itself is tested in test_peer_copy.py)
    assert chose["peer"] + chose["store"] == doc["experts"] and chose["store_gb_per_s"] > 0
    assert doc["peer_over_store"] > 0 and doc["peer_over_tier"] > 0 and doc["grpc_over_store"] > 0
    assert doc["streamed_over_region"] > 0 and "one ask a region" in printed
