"""The routing file: per-request, per-token top-k expert ids, from any source (the twin's workload).

One .npz ("moeless-routing/1"): topk [T, L, k] int16, every request's tokens concatenated
(prompt tokens first, then the tokens fed back while decoding); lengths [R] tokens per request;
prompt_tokens [R]; optional weights [T, L, k] float16 (the gate's); num_experts E; label (where
the routing came from: "recorded ..." or "moefied SmolLM2 routing at E=.., k=..", never a real
model's name for moefied routing). `moeless trace import` and `moeless trace record` write it;
twin/routing.token_loads turns a request's token ranges into [L, E] loads for the chunked scheduler.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

FORMAT = "moeless-routing/1"


class RoutingError(ValueError):
    """A routing log or routing file that cannot be used (the message names where and why)."""


@dataclass(frozen=True)
class Routing:
    """topk [T, L, k] expert ids; lengths [R]; prompt_tokens [R]; weights [T, L, k] or None; num_experts; label."""

    topk: np.ndarray
    lengths: np.ndarray
    prompt_tokens: np.ndarray
    num_experts: int
    label: str
    weights: np.ndarray | None = None

    @property
    def num_layers(self) -> int:
        return int(self.topk.shape[1])

    @property
    def top_k(self) -> int:
        return int(self.topk.shape[2])

    def request(self, r: int) -> np.ndarray:
        """Request r's tokens: [T_r, L, k]."""
        start = int(self.lengths[:r].sum())
        return self.topk[start:start + int(self.lengths[r])]


def save_routing(path: str | Path, routing: Routing) -> Path:
    """Write `routing` to one .npz (see the module docstring); returns the path."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    extra = {} if routing.weights is None else {"weights": routing.weights.astype(np.float16)}
    meta = json.dumps({"format": FORMAT, "num_experts": routing.num_experts, "label": routing.label})
    with open(path, "wb") as f:  # np.savez would append .npz to a path without it
        np.savez_compressed(f, topk=routing.topk.astype(np.int16), lengths=routing.lengths.astype(np.int64),
                            prompt_tokens=routing.prompt_tokens.astype(np.int64), meta=np.array(meta), **extra)
    return path


def load_routing(path: str | Path) -> Routing:
    """Read a file written by save_routing; RoutingError names the file and what is wrong."""
    path = Path(path)
    if not path.is_file():
        raise RoutingError(f"{path}: no such routing file; write one with `moeless trace import` or `moeless trace record`")
    try:
        with np.load(path) as f:
            meta = json.loads(str(f["meta"]))
            topk, lengths, prompt = f["topk"].astype(np.int64), f["lengths"], f["prompt_tokens"]
            weights = f["weights"].astype(np.float32) if "weights" in f else None
    except (KeyError, ValueError, OSError) as err:
        raise RoutingError(f"{path}: not a moeless routing file ({err})") from err
    if meta.get("format") != FORMAT:
        raise RoutingError(f"{path}: format {meta.get('format')!r}, expected {FORMAT!r}")
    if topk.ndim != 3 or lengths.sum() != len(topk) or len(prompt) != len(lengths) or len(lengths) == 0:
        raise RoutingError(f"{path}: inconsistent routing file (topk {topk.shape}, {len(lengths)} requests of {lengths.sum()} tokens)")
    return Routing(topk, lengths, prompt, int(meta["num_experts"]), str(meta["label"]), weights)
