"""The routing logs shipped with moeless: selectable by name (`--routing flame-moe-290m`, `trace import
NAME`), imported into the cache once, listed with their provenance, shipped in the package."""

from __future__ import annotations

import fnmatch
import tomllib
from pathlib import Path

import numpy as np
import pytest

from moeless.cli import main
from moeless.traces.routing_file import RoutingError
from moeless.traces.shipped import LOGS_DIR, SHIPPED, routing_path

ROOT = Path(__file__).resolve().parents[2]


def test_the_logs_hold_what_their_provenance_says(shipped):
    for name, log in SHIPPED.items():
        routing = shipped[name]
        assert (routing.num_experts, routing.top_k, routing.num_layers) == (log.experts, log.top_k, log.layers) == (64, 6, 8)
        assert len(routing.lengths) == log.requests and routing.lengths.sum() == log.tokens
        assert (routing.prompt_tokens == routing.lengths).all()  # prefill only: no decode token in the log
        assert routing.weights is not None and (routing.weights > 0).all() and (routing.weights.sum(-1) < 1).all()
        assert f"FLAME-MoE-290M, shipped log {name}" in routing.label and "Apache-2.0" in routing.label
    main_log, held = shipped["flame-moe-290m"], shipped["flame-moe-290m-heldout"]
    assert main_log.lengths.tolist() == [512] * 4 and held.lengths.tolist() == [10] * 60
    # The first record is the upstream dataset card's example (iteration 5473, layer 2, row 0).
    assert main_log.topk[0, 0].tolist() == [34, 28, 21, 47, 3, 12]
    assert np.allclose(main_log.weights[0, 0, :2], [0.0998, 0.0523], atol=1e-4)
    # The held-out windows' first tokens are not the main log's.
    assert not any(np.array_equal(held.request(r), main_log.request(q)[:10]) for r in range(60) for q in range(4))


def test_a_name_is_imported_once_and_an_unknown_one_is_one_line(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))
    first = routing_path("flame-moe-290m-heldout")
    assert first.parent == tmp_path / "routing" and first.name.startswith("flame-moe-290m-heldout-")
    stamp = first.stat().st_mtime_ns
    assert routing_path("flame-moe-290m-heldout") == first and first.stat().st_mtime_ns == stamp
    with pytest.raises(RoutingError, match=r"flame-moe-29: no such routing file and no shipped log of that name "
                                           r"\(shipped: flame-moe-290m, flame-moe-290m-heldout"):
        routing_path("flame-moe-29")


def test_trace_list_and_import_by_name(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))
    assert main(["trace", "list"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, line in zip(SHIPPED, lines):
        assert line.startswith(f"{name}: FLAME-MoE-290M, E=64 routed, k=6, 8 MoE layers")
        assert "Apache-2.0" in line and "CMU-FLAME/FLAME-MoE-Traces" in line and "no licence file" in line
    assert "held out" in lines[1] and "PROVENANCE.md" in lines[-1]
    out = tmp_path / "held.npz"
    assert main(["trace", "import", "flame-moe-290m-heldout", "--out", str(out)]) == 0
    assert "60 requests, 600 tokens, 8 layers, E=64, k=6" in capsys.readouterr().out and out.is_file()
    assert main(["trace", "import", "flame-moe-290m-heldout", "--experts", "128", "--out", str(out)]) == 2
    assert "has E=64, --experts says 128" in capsys.readouterr().err


def test_eval_checks_a_named_log_against_the_geometry(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))
    for routing, says in (("flame-moe-290m", "--routing flame-moe-290m: E=64, k=6, but mixtral-8x7b has E=8, k=2"),
                          ("flame-moe-29", "flame-moe-29: no such routing file and no shipped log of that name")):
        assert main(["eval", "--geometry", "mixtral-8x7b", "--routing", routing, "--out", str(tmp_path / "x")]) == 2
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1


def test_the_logs_ship_in_the_package_and_the_image():
    data = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]["moeless.traces.logs"]
    files = sorted(p.name for p in LOGS_DIR.iterdir())
    assert {log.file for log in SHIPPED.values()} | {"PROVENANCE.md"} == set(files)
    assert all(any(fnmatch.fnmatch(f, pattern) for pattern in data) for f in files)
    assert sum((LOGS_DIR / f).stat().st_size for f in files) < 1_000_000  # the repository stays small
    ignored = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()]
    assert not any(fnmatch.fnmatch(f"traces/logs/{f}", p) or fnmatch.fnmatch("traces", p) for f in files for p in ignored)
    provenance = (LOGS_DIR / "PROVENANCE.md").read_text()
    for says in ("f274466b9095e0b417f701a3ef3a14a6639b6aed", "license: apache-2.0", "no licence file",
                 "scripts/convert_flame_routing.py", "arXiv:2505.20225", "renormalised"):
        assert says in provenance, says
