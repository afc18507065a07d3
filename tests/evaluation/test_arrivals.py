"""Arrival traces: both real formats read row by row, bad rows refused naming the line, the generated
process's rate and burstiness, the fallback when the traces folder is missing."""

from __future__ import annotations

import json
from datetime import datetime

import numpy as np
import pytest

from moeless.twin.arrivals import traces_dir
from moeless.twin import arrivals as arr

AZURE = "TIMESTAMP,ContextTokens,GeneratedTokens\n" \
        "2023-11-16 18:15:46.6805900,374,44\n2023-11-16 18:15:50.9951690,396,109\n2023-11-16 18:15:51.0000000,10,0\n"


def write(tmp_path, name: str, text: str):
    path = tmp_path / name
    path.write_text(text)
    return path


def test_an_azure_trace_gives_seconds_since_the_first_arrival_and_output_lengths(tmp_path):
    got = arr.read_trace(write(tmp_path, "t.csv", AZURE))
    assert got.seconds == pytest.approx([0.0, 4.314578, 4.31941])
    assert got.output_tokens.tolist() == [44, 109, 0]
    assert "Azure" in got.source and "t.csv" in got.source
    capped = got.first(2, time_scale=0.5)
    assert capped.seconds == pytest.approx([0.0, 2.157289]) and capped.output_tokens.tolist() == [44, 109]


def test_a_mooncake_trace_reads_milliseconds(tmp_path):
    rows = [{"timestamp": 0, "input_length": 6758, "output_length": 500, "hash_ids": [0, 1]},
            {"timestamp": 1500, "input_length": 20, "output_length": 3, "hash_ids": [2]}]
    got = arr.read_trace(write(tmp_path, "m.jsonl", "".join(json.dumps(r) + "\n" for r in rows)))
    assert got.seconds.tolist() == [0.0, 1.5] and got.output_tokens.tolist() == [500, 3]


@pytest.mark.parametrize("text, line, says", [
    (AZURE + "2023-11-16 18:15:52.0,5\n", 5, "expected 3 fields"),
    (AZURE + "yesterday,5,6\n", 5, "TIMESTAMP"),
    (AZURE + "2023-11-16 18:15:52.0,5,-1\n", 5, "GeneratedTokens must be a whole number"),
    (AZURE + "2023-11-16 18:15:52.0,five,1\n", 5, "ContextTokens"),
    (AZURE + "2023-11-16 18:15:40.0,5,1\n", 5, "goes back in time"),
    ("time,in,out\n1,2,3\n", 1, "header"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 2}\n{"timestamp": 5}\n', 2, "output_length"),
    ('{"timestamp": 0, "input_length": 1, "output_length": 2}\nnot json\n', 2, "not a JSON object"),
])
def test_a_bad_row_is_one_error_naming_the_file_line_and_field(tmp_path, text, line, says):
    path = write(tmp_path, "bad.trace", text)
    with pytest.raises(arr.TraceError) as err:
        arr.read_trace(path)
    message = str(err.value)
    assert f"{path}:{line}:" in message and says in message and "\n" not in message


def test_missing_and_empty_traces_are_errors(tmp_path):
    with pytest.raises(arr.TraceError, match="no such trace file"):
        arr.read_trace(tmp_path / "nope.csv")
    with pytest.raises(arr.TraceError, match="empty"):
        arr.read_trace(write(tmp_path, "e.csv", "\n"))
    with pytest.raises(arr.TraceError, match="no requests"):
        arr.read_trace(write(tmp_path, "h.csv", "TIMESTAMP,ContextTokens,GeneratedTokens\n"))


@pytest.mark.parametrize("cv", [0.5, 1.0, 3.0])
def test_the_generated_process_has_the_rate_and_burstiness_asked_for(cv):
    got = arr.generated(40_000, rate=5.0, cv=cv, seed=1)
    gaps = np.diff(got.seconds)
    assert got.seconds[0] == 0 and (gaps >= 0).all() and got.output_tokens is None
    assert 1 / gaps.mean() == pytest.approx(5.0, rel=0.05)
    assert gaps.std() / gaps.mean() == pytest.approx(cv, rel=0.08)
    assert np.array_equal(arr.generated(100, 5.0, cv, seed=1).seconds, got.seconds[:100])  # seeded


def test_named_traces_come_from_the_traces_folder_or_fall_back_to_the_generated_process(tmp_path, monkeypatch):
    monkeypatch.setenv("MOELESS_TRACES", str(tmp_path))
    fallback = arr.resolve("azure-conv", 50)
    assert len(fallback.seconds) == 50 and "not found" in fallback.source and fallback.output_tokens is None
    write(tmp_path, arr.NAMED_TRACES["azure-conv"], AZURE)
    assert arr.resolve("azure-conv", 50).output_tokens.tolist() == [44, 109, 0]
    with pytest.raises(arr.TraceError, match="no such trace file"):
        arr.resolve(str(tmp_path / "missing.csv"), 5)  # a path the user gave must exist


def test_the_real_conversation_trace_when_present_else_the_fallback():
    """With ../shared/data/traces: its first arrivals, checked against the file parsed independently;
    without it (a user's clone): the generated process at the trace's rate."""
    path = traces_dir() / arr.AZURE_CONV_FILE
    got = arr.resolve("azure-conv", 200).first(200)
    if path.is_file():
        rows = path.read_text().splitlines()[1:201]
        stamps = [datetime.strptime(r.split(",")[0][:26], "%Y-%m-%d %H:%M:%S.%f") for r in rows]
        expected = [(s - stamps[0]).total_seconds() for s in stamps]
        assert got.seconds == pytest.approx(expected, abs=1e-6)
        assert got.output_tokens.tolist() == [int(r.split(",")[2]) for r in rows]
    else:
        assert "not found" in got.source
        assert 1 / np.diff(got.seconds).mean() == pytest.approx(arr.DEFAULT_RATE, rel=0.3)
