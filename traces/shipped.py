"""The routing logs shipped with moeless (traces/logs/), selectable by name wherever a routing file
is asked for: `moeless eval --routing flame-moe-290m`, `moeless trace import flame-moe-290m`.

Why shipped: a planner judged only on moefied routing (the default model rebuilt at a geometry's
E and k) is judged on a stand-in; a recorded log of a real fine-grained MoE must work in a fresh
clone without the network. Each log is gzipped JSONL as `moeless trace import` reads it (one
record per token and layer), imported into the cache on first use. Where each came from, its
licence and how it was converted: traces/logs/PROVENANCE.md (scripts/convert_flame_routing.py
writes the files).
"""

from __future__ import annotations

import hashlib
import os
from dataclasses import dataclass, replace
from pathlib import Path

from moeless.core.paths import cache_dir
from moeless.traces.routing_file import Routing, RoutingError, load_routing, save_routing
from moeless.traces.routing_import import import_routing

LOGS_DIR = Path(__file__).resolve().parent / "logs"
FLAME_SOURCE = ("CMU-FLAME/FLAME-MoE-Traces (Hugging Face; Apache-2.0 per its card), as mirrored in "
                "github.com/Akash-N-Pai/DynaNDE-Simulator@f274466b (no licence file)")


@dataclass(frozen=True)
class ShippedLog:
    """A shipped routing log: its name, file (in LOGS_DIR) and the facts its provenance line gives."""

    name: str
    file: str
    model: str
    experts: int
    top_k: int
    layers: int
    requests: int
    tokens: int
    text: str
    phases: str
    licence: str
    source: str
    use: str

    @property
    def path(self) -> Path:
        return LOGS_DIR / self.file

    def provenance(self) -> str:
        """One line: what the log is, where it came from, under which licence, what it is for."""
        return (f"{self.name}: {self.model}, E={self.experts} routed, k={self.top_k}, {self.layers} MoE layers; "
                f"{self.requests} x {self.tokens // self.requests} = {self.tokens:,} tokens of {self.text}; "
                f"phases: {self.phases}; {self.licence}; from {self.source}; {self.use}")


SHIPPED = {log.name: log for log in (
    ShippedLog("flame-moe-290m", "flame-moe-290m.jsonl.gz", "FLAME-MoE-290M", 64, 6, 8, 4, 2048,
               "pretraining text at the final checkpoint (iteration 5473): 4 consecutive 512-token windows of capture shard 0-0",
               "prefill only (teacher-forced)", "Apache-2.0", FLAME_SOURCE, "a workload"),
    ShippedLog("flame-moe-290m-heldout", "flame-moe-290m-heldout.jsonl.gz", "FLAME-MoE-290M", 64, 6, 8, 60, 600,
               "pretraining text at iteration 5473: the first 10 tokens of windows 4-63, disjoint from flame-moe-290m's",
               "prefill only (teacher-forced)", "Apache-2.0", FLAME_SOURCE,
               "held out: for checks of what is fitted on flame-moe-290m"),
)}


def shipped_routing(name: str) -> Path:
    """The routing file of shipped log `name` in the cache, imported from traces/logs/ on first use
    under a key of the log's bytes and its label (an edited log or label is imported again)."""
    log = SHIPPED[name]
    if not log.path.is_file():
        raise RoutingError(f"{log.path}: the shipped log {name} is missing from this install (reinstall moeless)")
    label = f"recorded routing of {log.model}, shipped log {name}: {log.tokens:,} tokens, {log.phases}, {log.licence}"
    key = hashlib.sha256(log.path.read_bytes() + label.encode()).hexdigest()[:12]
    out = cache_dir() / "routing" / f"{name}-{key}.npz"
    if out.is_file():
        return out
    routing = import_routing(log.path, log.experts)
    facts = (routing.num_experts, routing.top_k, routing.num_layers, len(routing.lengths), int(routing.lengths.sum()))
    if facts != (log.experts, log.top_k, log.layers, log.requests, log.tokens):
        raise RoutingError(f"{log.path}: (E, k, layers, requests, tokens) = {facts}, its provenance says "
                           f"{(log.experts, log.top_k, log.layers, log.requests, log.tokens)}")
    tmp = out.with_name(f".{out.stem}.{os.getpid()}.tmp")
    save_routing(tmp, replace(routing, label=label))
    os.replace(tmp, out)  # atomic: a concurrent reader sees the whole file or none
    return out


def routing_path(spec: str) -> Path:
    """The routing file `spec` names: a shipped log's name (imported into the cache on first use) or
    a path; neither is one RoutingError that lists the shipped names."""
    if spec in SHIPPED:
        return shipped_routing(spec)
    path = Path(spec)
    if not path.is_file():
        raise RoutingError(f"{spec}: no such routing file and no shipped log of that name (shipped: "
                           f"{', '.join(SHIPPED)}; `moeless trace list`); write a file with `moeless trace import`")
    return path


def load_named_routing(spec: str) -> Routing:
    """The Routing of a shipped log's name or of a routing file's path."""
    return load_routing(routing_path(spec))
