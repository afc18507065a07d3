"""Shared plumbing of `moeless bench X`: the common flags and writing results as JSON."""

from __future__ import annotations

import argparse
import json
import logging
import os
import platform
import time
from pathlib import Path
from typing import Any, Callable

from moeless.expert_fn.wire.polling import DEFAULT_CLIENT_POLL_S, DEFAULT_HOST_POLL_S


log = logging.getLogger(__name__)


def start_local_ray(retries: int = 1) -> None:
    """A local Ray for a bench, on every core. A start that times out (a GCS slow to come up on a
    loaded machine: "The current node timed out during startup", or "Timed out waiting for file
    .../gcs_server_port_...") is tried again after a clean shutdown, `retries` times."""
    import ray  # heavy: kept off --help's start-up path

    for attempt in range(retries + 1):
        try:
            ray.init(num_cpus=os.cpu_count() or 2, include_dashboard=False, log_to_driver=False, logging_level="ERROR")
            return
        except Exception as err:
            if attempt == retries or "timed out" not in str(err).lower():
                raise
            log.warning("Ray did not start (%s); trying again", err)
            ray.shutdown()
            time.sleep(2.0)


def add_bench_flags(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--out", metavar="DIR", help="write results as JSON (and plots) into DIR")
    parser.add_argument("--quick", action="store_true", help="a small run that finishes in under a minute")


def add_poll_flag(parser: argparse.ArgumentParser) -> None:
    """--poll-us HOST CLIENT: the data plane's busy-polling (expert_fn/wire/polling.py)."""
    parser.add_argument("--poll-us", type=float, nargs=2, metavar=("HOST", "CLIENT"),
                        help="spin for calls (hosts) and answers (clients) this many microseconds before blocking "
                             "(default: the hosts' and clients' defaults)")


def poll_from_args(args: argparse.Namespace) -> tuple[float, float]:
    """(host, client) poll seconds from --poll-us, else the defaults."""
    if args.poll_us is None:
        return DEFAULT_HOST_POLL_S, DEFAULT_CLIENT_POLL_S
    if min(args.poll_us) < 0:
        raise SystemExit("--poll-us: microseconds must be >= 0")
    return args.poll_us[0] / 1e6, args.poll_us[1] / 1e6


def write_result(out: str | None, name: str, result: dict[str, Any]) -> Path | None:
    """Write result (plus machine facts) to DIR/<name>.json when --out was given; return the path."""
    if not out:
        return None
    path = Path(out)
    path.mkdir(parents=True, exist_ok=True)
    doc = {"bench": name, "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"), "machine": platform.platform(), **result}
    target = path / f"{name}.json"
    target.write_text(json.dumps(doc, indent=1, default=_jsonable))
    return target


def print_and_write(out: str | None, name: str, result: dict[str, Any], print_report: Callable[[dict], None]) -> int:
    """A bench's tail: print_report(result), then write_result (saying where); the exit status, 0."""
    print_report(result)
    path = write_result(out, name, result)
    if path:
        print(f"wrote {path}")
    return 0


def _jsonable(value: Any) -> Any:
    if hasattr(value, "tolist"):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")
