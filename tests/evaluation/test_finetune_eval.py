"""`moeless eval --shared-pool --finetunes ...`: a quick run writes the report (every way for every
cell, the targets with their numbers), re-renders to the same bytes and becomes a section of the
shared pool's report; bad flags are one error line."""

from __future__ import annotations

import json

import pytest

from moeless.cli import main


def test_a_quick_finetunes_run_writes_the_report(tmp_path):
    out = tmp_path / "run"
    argv = ["eval", "--shared-pool", "--quick", "--finetunes", "1", "4", "--replaced", "0", "0.15", "--geometry",
            "mixtral-8x7b", "--levels", "1", "--step-lag", "1", "--out", str(out), "--markdown", str(tmp_path / "finetunes.md")]
    assert main(argv) == 0
    md = (tmp_path / "finetunes.md").read_text()
    for says in ("--finetunes 1 4 --replaced 0 0.15 --step-lag 1 --out", "## The bases", "shared-keys GPU-s", "(run/gpu-seconds.png)",
                 "## The targets", "batched (worst)", "sized for its step SLO", "newcomers waiting for a scale-up",
                 "base-warm wake with that wait",
                 "mixtral-8x7b | 15% | 4 | 1 |"):
        assert says in md, says
    run = json.loads((out / "run.json").read_text())
    cells = {(c["replaced"], c["finetunes"]): c for c in run["cells"]}
    assert sorted(cells) == [(0.0, 1), (0.0, 4), (0.15, 1), (0.15, 4)]
    assert cells[0.15, 1]["gpu_s"]["shared-keys"] == cells[0.15, 1]["gpu_s"]["expert-grain"]  # one fine-tune: no sharing
    assert all(m["own_experts"] == 0 for m in cells[0.0, 4]["models"])
    assert {m["own_experts"] for m in cells[0.15, 4]["models"]} == {38}
    four = cells[0.15, 4]
    assert four["gpu_s"]["shared-keys"] < four["gpu_s"]["expert-grain"] <= four["gpu_s"]["whole-model"] + 1e-9
    assert sum(m["gb_s"]["shared-keys"] for m in four["models"]) == pytest.approx(four["gb_s_shared_keys"])
    assert four["gpu_s_sized_for_step"] >= four["gpu_s"]["shared-keys"]  # the step's SLO only adds GPUs
    assert four["gpu_s_whole_model_own_gpus"] >= four["gpu_s"]["whole-model"]  # no two models on one GPU: more GPUs
    assert all(m["step_p99_s"]["shared-keys-batched-gated"] <= m["step_p99_s"]["shared-keys-batched-sized"]
               for m in four["models"])
    assert (out / "gpu-seconds.png").stat().st_size > 0 and (out / "finetunes.csv").read_text().count("\n") == 1 + 10
    assert main(["report", str(out)]) == 0 and (out / "report.md").read_text() == md.replace("](run/", "](")


def test_a_finetunes_run_beside_a_shared_pool_run_is_a_section_of_its_report(tmp_path):
    out = tmp_path / "pool"
    assert main(["eval", "--shared-pool", "--quick", "--geometry", "mixtral-8x7b", "--levels", "1", "--out", str(out)]) == 0
    alone = (out / "report.md").read_text()
    assert "fine-tunes" not in alone
    assert main(["eval", "--shared-pool", "--quick", "--finetunes", "2", "--replaced", "0.05", "--geometry", "mixtral-8x7b",
                 "--out", str(out / "finetunes")]) == 0
    cells = json.loads((out / "finetunes" / "run.json").read_text())["cells"]
    assert [c["requests_per_minute"] for c in cells] == [1.0]  # --quick: the level alone
    assert main(["report", str(out), "--markdown", str(tmp_path / "shared-pool.md")]) == 0
    md = (tmp_path / "shared-pool.md").read_text()
    assert md.startswith(alone.replace("](", "](pool/")) and "\n## Many fine-tunes of one base" in md
    assert "(pool/finetunes/gpu-seconds.png)" in md and "### The targets" in md


@pytest.mark.parametrize("flags, says", [
    (["--shared-pool", "--finetunes", "0"], "--finetunes: counts from 1 to 64, got 0"),
    (["--shared-pool", "--finetunes", "65"], "--finetunes: counts from 1 to 64"),
    (["--shared-pool", "--finetunes", "4", "--replaced", "1"], "--replaced: shares of a base's experts in [0, 1), got 1"),
    (["--shared-pool", "--replaced", "0.1"], "--replaced: give --finetunes N too"),
    (["--finetunes", "4"], "--finetunes and --replaced are for the shared pool"),
    (["--shared-pool", "--finetunes", "4", "--step-hold", "-1"], "--step-hold: seconds, 0 or more; got -1"),
    (["--shared-pool", "--finetunes", "4", "--step-lag", "-0.5"], "--step-lag: seconds, 0 or more; got -0.5"),
    (["--shared-pool", "--finetunes", "4", "--peer-copy-ms", "-1"], "--peer-copy-ms: milliseconds, 0 or more; got -1"),
    (["--shared-pool", "--finetunes", "4", "--peer-batch-mb", "-64"], "--peer-batch-mb: MB, 0 or more; got -64"),
])
def test_bad_finetune_flags_are_one_error_line(tmp_path, capsys, flags, says):
    assert main(["eval", "--quick", *flags, "--out", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err.strip()
    assert says in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "x").exists()


def test_scale_ups_that_load_from_host_memory_wait_longer_than_peer_copies_and_the_report_says_so(tmp_path):
    """--scale-up-copies host: the added GPUs load their keys as serving's expert hosts do (each spare
    from its own store), not from a peer GPU; the waits for a scale-up grow, the GPU-seconds do not.
    --peer-copy-ms 0: peer copies without the expert host's measured fixed cost wait less; --peer-batch-mb
    800 (two of Mixtral's 352 MB experts an ask): between the two."""
    runs = {}
    for name, flags in (("peer", ["--scale-up-copies", "peer"]), ("host", ["--scale-up-copies", "host"]),
                        ("free", ["--peer-copy-ms", "0"]), ("batched", ["--peer-batch-mb", "800"])):
        out = tmp_path / name
        assert main(["eval", "--shared-pool", "--quick", "--finetunes", "4", "--replaced", "0.15", "--geometry",
                     "mixtral-8x7b", "--levels", "1", *flags, "--out", str(out)]) == 0
        runs[name] = json.loads((out / "run.json").read_text())["cells"][0]
    peer, host, free = runs["peer"], runs["host"], runs["free"]
    waited = [(a, b) for a, b in zip(free["models"], peer["models"]) if a["scale_up_waits"]["count"]]
    assert waited and all(b["scale_up_waits"]["p99"] > a["scale_up_waits"]["p99"] > 0 for a, b in waited)
    assert "--peer-copy-ms 0 --out" in (tmp_path / "free" / "report.md").read_text()
    waits = [[m["scale_up_waits"]["p99"] for m in ms] for ms in zip(*(runs[n]["models"] for n in ("free", "batched", "peer")))
             if ms[0]["scale_up_waits"]["count"]]
    assert waits and all(a <= b <= c for a, b, c in waits) and any(a < b < c for a, b, c in waits), waits
    md = (tmp_path / "batched" / "report.md").read_text()
    assert "--peer-batch-mb 800 --out" in md and "an ask carrying the replicas that fit 800 MB" in md
    assert host["gpu_s_sized_for_step"] == peer["gpu_s_sized_for_step"]
    waited = [(a, b) for a, b in zip(peer["models"], host["models"]) if a["scale_up_waits"]["count"]]
    assert waited and all(b["scale_up_waits"]["p99"] > a["scale_up_waits"]["p99"] > 0 for a, b in waited)
    for a, b in zip(peer["models"], host["models"]):
        assert b["step_p99_s"]["shared-keys-batched-sized"] >= a["step_p99_s"]["shared-keys-batched-sized"]
    md = (tmp_path / "host" / "report.md").read_text()
    assert "--scale-up-copies host --out" in md and "loading their keys from host memory" in md
    assert "--scale-up-copies" not in (tmp_path / "peer" / "report.md").read_text()  # the default: not in its command
