"""The benches' shared parts (moeless/bench/common.py): the report printed, the JSON written only
with --out, with the machine's facts beside the figures; a local Ray started again once where its start timed out."""

import pytest
import json

from moeless.bench.common import print_and_write


def test_print_and_write_prints_the_report_then_writes_the_json_where_out_says(tmp_path, capsys):
    printed = []
    assert print_and_write(str(tmp_path / "run"), "step-scaler", {"holds": [0.1]}, printed.append) == 0
    doc = json.loads((tmp_path / "run" / "step-scaler.json").read_text())
    assert printed == [{"holds": [0.1]}] and doc["holds"] == [0.1] and doc["bench"] == "step-scaler" and doc["machine"]
    assert f"wrote {tmp_path / 'run' / 'step-scaler.json'}" in capsys.readouterr().out


def test_without_out_nothing_is_written(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert print_and_write(None, "load", {"x": 1}, lambda r: print("report", r["x"])) == 0
    assert capsys.readouterr().out == "report 1\n" and not list(tmp_path.iterdir())


@pytest.mark.parametrize("timed_out", [
    Exception("The current node timed out during startup."),
    RuntimeError("Timed out waiting for file /tmp/ray/session_x/gcs_server_port_ab0a"),  # seen in a CI run
])
def test_a_local_ray_that_times_out_starting_is_started_again_once_and_other_errors_are_raised(monkeypatch, timed_out):
    import ray

    from moeless.bench import common

    calls, shutdowns = [], []

    def init(**kwargs):
        calls.append(kwargs)
        if len(calls) == 1:
            raise timed_out

    monkeypatch.setattr(ray, "init", init)
    monkeypatch.setattr(ray, "shutdown", lambda: shutdowns.append(1))
    monkeypatch.setattr(common.time, "sleep", lambda s: None)
    common.start_local_ray()
    assert len(calls) == 2 and shutdowns == [1] and calls[0]["include_dashboard"] is False

    def broken(**kwargs):
        raise RuntimeError("no such resource")

    monkeypatch.setattr(ray, "init", broken)
    with pytest.raises(RuntimeError, match="no such resource"):
        common.start_local_ray()
