"""Request arrivals, the twin's one reader: a real trace file, or a generated process when there is none.

Formats (the real traces in ../shared/data/traces, or any file of the same shape):
- Azure LLM inference trace 2023 CSV: header `TIMESTAMP,ContextTokens,GeneratedTokens`, rows like
  `2023-11-16 18:15:46.6805900,374,44`, timestamps in order;
- Mooncake JSONL: one `{"timestamp": ms, "input_length": n, "output_length": n, "hash_ids": [...]}`
  per line, timestamps in order.
Every row is checked; the first bad one is a TraceError naming the file, the line and what is wrong.

The generated process is a gamma renewal process: inter-arrival gaps ~ Gamma(shape 1/cv^2,
scale cv^2/rate), so the mean rate is `rate` requests/s and the gaps' coefficient of variation is
`cv` (1 is Poisson; larger is burstier). Defaults: the Azure conversation trace's mean rate (19,365
requests in its hour) and its measured inter-arrival CV (1.09).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

AZURE_CONV_FILE = "AzureLLMInferenceTrace_conv.csv"
AZURE_CONV_RATE = 19_365 / 3_600.0  # requests per second over the trace's hour (its README)
DEFAULT_RATE = AZURE_CONV_RATE
DEFAULT_CV = 1.1  # the Azure conversation trace's inter-arrival CV, measured: 1.09
NAMED_TRACES = {  # names `--workload` accepts for the files of the traces folder
    "azure-conv": AZURE_CONV_FILE,
    "azure-code": "AzureLLMInferenceTrace_code.csv",
    "mooncake": "mooncake_conversation_trace.jsonl",
}
AZURE_HEADER = "TIMESTAMP,ContextTokens,GeneratedTokens"


class TraceError(ValueError):
    """An arrival trace that is missing, empty or has a bad row (the message names file and line)."""


@dataclass(frozen=True)
class Arrivals:
    """seconds: [N] arrival times since the first (non-decreasing); output_tokens: [N] tokens each
    request generates (None for a generated process); source: where they came from, in words."""

    seconds: np.ndarray
    output_tokens: np.ndarray | None
    source: str

    def first(self, count: int, time_scale: float = 1.0) -> "Arrivals":
        """The first `count` arrivals (all if fewer), times multiplied by time_scale (0.5: twice the rate)."""
        if count <= 0 or not time_scale > 0:
            raise TraceError(f"need a request cap > 0 and a time scale > 0, got {count} and {time_scale}")
        n = min(count, len(self.seconds))
        out = None if self.output_tokens is None else self.output_tokens[:n]
        scale = "" if time_scale == 1 else f", times x {time_scale:g}"
        return Arrivals(self.seconds[:n] * time_scale, out, f"{self.source}, first {n} arrivals{scale}")


def read_trace(path: str | Path) -> Arrivals:
    """An Azure CSV or Mooncake JSONL trace (by content: a JSONL line starts with '{')."""
    path = Path(path)
    try:
        text = path.read_text()
    except FileNotFoundError:
        raise TraceError(f"{path}: no such trace file; give an Azure CSV or Mooncake JSONL trace, or leave it out "
                         "for a generated arrival process") from None
    except (OSError, UnicodeDecodeError) as err:
        raise TraceError(f"{path}: cannot read the trace ({err})") from None
    lines = text.splitlines()
    if not lines or not any(line.strip() for line in lines):
        raise TraceError(f"{path}: the trace is empty")
    reader = _read_mooncake if lines[0].lstrip().startswith("{") else _read_azure
    stamps, outputs, kind = reader(path, lines)
    if not stamps:
        raise TraceError(f"{path}: the trace has a header but no requests")
    seconds = np.asarray(stamps, dtype=np.float64)
    return Arrivals(seconds - seconds[0], np.asarray(outputs, dtype=np.int64), f"{kind} ({path.name})")


def _read_azure(path: Path, lines: list[str]) -> tuple[list[float], list[int], str]:
    if lines[0].strip() != AZURE_HEADER:
        raise TraceError(f"{path}:1: expected the Azure trace header {AZURE_HEADER!r} (or Mooncake JSONL), got {lines[0][:60]!r}")
    stamps, outputs = [], []
    for number, line in enumerate(lines[1:], start=2):
        if not line.strip():
            continue
        cells = line.split(",")
        where = f"{path}:{number}: bad row {line[:60]!r}"
        if len(cells) != 3:
            raise TraceError(f"{where}: expected 3 fields {AZURE_HEADER}, got {len(cells)}")
        try:
            stamp = int(np.datetime64(cells[0].strip(), "ns").astype(np.int64))  # ns: exact until the first is subtracted
        except ValueError:
            raise TraceError(f"{where}: TIMESTAMP is not a date-time like 2023-11-16 18:15:46.6805900") from None
        _tokens(cells[1], f"{where}: ContextTokens")
        outputs.append(_tokens(cells[2], f"{where}: GeneratedTokens"))
        _in_order(stamps, stamp, where)
        stamps.append(stamp)
    return [(ns - stamps[0]) * 1e-9 for ns in stamps], outputs, "Azure LLM trace"


def _read_mooncake(path: Path, lines: list[str]) -> tuple[list[float], list[int], str]:
    stamps, outputs = [], []
    for number, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{path}:{number}: bad row {line[:60]!r}"
        try:
            row = json.loads(line)
        except json.JSONDecodeError:
            raise TraceError(f"{where}: not a JSON object") from None
        if not isinstance(row, dict) or not {"timestamp", "input_length", "output_length"} <= set(row):
            raise TraceError(f"{where}: expected an object with timestamp (ms), input_length and output_length")
        stamp = row["timestamp"]
        if isinstance(stamp, bool) or not isinstance(stamp, (int, float)) or not math.isfinite(stamp):
            raise TraceError(f"{where}: timestamp must be a number of milliseconds")
        _tokens(row["input_length"], f"{where}: input_length")
        outputs.append(_tokens(row["output_length"], f"{where}: output_length"))
        _in_order(stamps, stamp / 1e3, where)
        stamps.append(stamp / 1e3)
    return stamps, outputs, "Mooncake trace"


def _tokens(value, where: str) -> int:
    """A token count: a non-negative integer (text from a CSV cell or a JSON number)."""
    try:
        count = int(value.strip()) if isinstance(value, str) else value
    except ValueError:
        count = None
    if isinstance(count, bool) or not isinstance(count, int) or count < 0:
        raise TraceError(f"{where} must be a whole number >= 0, got {value!r}")
    return count


def _in_order(stamps: list[float], stamp: float, where: str) -> None:
    if stamps and stamp < stamps[-1]:
        raise TraceError(f"{where}: timestamp goes back in time (rows must be in arrival order)")


def generated(count: int, rate: float = DEFAULT_RATE, cv: float = DEFAULT_CV, seed: int = 0) -> Arrivals:
    """`count` arrivals of the gamma renewal process (see the module docstring)."""
    if count <= 0 or not rate > 0 or not cv > 0:
        raise TraceError(f"a generated process needs count > 0, rate > 0 and burstiness (CV) > 0, got {count}, {rate}, {cv}")
    shape = 1.0 / cv**2
    gaps = np.random.default_rng(seed).gamma(shape, 1.0 / (rate * shape), size=count)
    seconds = np.concatenate([[0.0], np.cumsum(gaps[1:])])
    return Arrivals(seconds, None, f"generated gamma-renewal arrivals, {rate:.2f} requests/s, inter-arrival CV {cv:g}, seed {seed}")


def resolve(trace: str | None, count: int, rate: float = DEFAULT_RATE, cv: float = DEFAULT_CV, seed: int = 0) -> Arrivals:
    """Arrivals for a workload's trace: a file path, a name of NAMED_TRACES (looked up in the traces
    folder: $MOELESS_TRACES, else ../shared/data/traces beside the checkout), or None / "generated"
    (`count` arrivals of the generated process).

    A named trace that is not there (a user's clone) falls back to the generated process and says
    so in its source; a path that is not there is an error."""
    if trace in (None, "", "generated"):
        return generated(count, rate, cv, seed)
    if trace in NAMED_TRACES:
        path = traces_dir() / NAMED_TRACES[trace]
        if not path.is_file():
            fallback = generated(count, rate, cv, seed)
            return Arrivals(fallback.seconds, None, f"{fallback.source} ({trace}: {path} not found)")
        return read_trace(path)
    return read_trace(trace)


def traces_dir() -> Path:
    """$MOELESS_TRACES, else ../shared/data/traces beside the source checkout (the project's real
    traces; a user's clone has none, and callers fall back to a generated arrival process)."""
    env = os.environ.get("MOELESS_TRACES")
    return Path(env) if env else Path(__file__).resolve().parents[2] / "shared" / "data" / "traces"


def arrival_times(count: int, path: Path | None = None, seed: int = 0, rate_scale: float = 1.0) -> tuple[np.ndarray, str]:
    """Seconds since the first arrival of `count` requests: ([count], a line saying where they came from).

    The Azure conversation trace (`path`, default its file in the traces folder), its first `count`
    arrivals (a short file repeats, shifted by its own span), else a Poisson process (the generated
    process at CV 1) at the trace's mean rate. rate_scale > 1 compresses time (more requests per second).
    """
    path = path or traces_dir() / AZURE_CONV_FILE
    if count <= 0:
        raise ValueError(f"need at least one request, got {count}")
    if rate_scale <= 0:
        raise ValueError(f"rate_scale must be positive, got {rate_scale}")
    if not path.is_file():
        poisson = generated(count, AZURE_CONV_RATE, cv=1.0, seed=seed)
        return poisson.seconds / rate_scale, f"Poisson arrivals at {AZURE_CONV_RATE:.2f}/s ({path} not found)"
    seconds = read_trace(path).seconds[:count]
    if len(seconds) < count:
        reps = -(-count // len(seconds))
        span = seconds[-1] + 1.0 / AZURE_CONV_RATE
        seconds = np.concatenate([seconds + r * span for r in range(reps)])[:count]
    return seconds / rate_scale, f"Azure conversation trace ({path.name}), first {count} arrivals"
