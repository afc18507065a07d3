"""Routing traces for training and scoring predictors, split by prompt (never by token).

One PromptTrace is one prompt's prefill: per MoE layer, the hidden states entering the gate and
the gate's decision. The (layer l, distance d) training pairs are views of it: the hidden
states of layer l against the routing of layer l + d, so every distance shares one copy.

The split is by prompt text: a prompt's key is a hash of its text and model.datasets.split_of
puts the key on one side (70:30), so identical prompts always land on the same side.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field, replace
from pathlib import Path

import torch

from moeless.model.datasets import split_of

FORMAT = "moeless-routing-traces/1"


class TraceError(ValueError):
    """Routing traces that are inconsistent or do not fit the model or request."""


@dataclass(frozen=True)
class PromptTrace:
    """One prompt's prefill through every MoE layer.

    hidden: [L, T, H] float16 or float32, gate input of each layer; idx: [L, T, k] long, experts chosen;
    load: [L, E] long, tokens per expert; trajectory: [L, E] float, mean gate probability.
    """

    key: str
    split: str
    hidden: torch.Tensor
    idx: torch.Tensor
    load: torch.Tensor
    trajectory: torch.Tensor

    @property
    def num_tokens(self) -> int:
        return int(self.hidden.shape[1])


@dataclass(frozen=True)
class RoutingTraces:
    """Traces of many prompts from one model (identified by its fingerprint)."""

    model_hash: str
    num_layers: int
    num_experts: int
    top_k: int
    hidden_size: int
    traces: tuple[PromptTrace, ...] = field(default=())

    def split(self, name: str) -> "RoutingTraces":
        """The traces of split `name` ("train" or "test")."""
        if name not in ("train", "test"):
            raise TraceError(f"split must be 'train' or 'test', got {name!r}")
        return replace(self, traces=tuple(t for t in self.traces if t.split == name))

    def holdout(self) -> tuple["RoutingTraces", "RoutingTraces"]:
        """(fit, validation): the traces divided 70:30 by prompt with a second, independent hash.

        Fine-tuning fits on the first and judges on the second, so the test split stays unseen.
        """
        side = {t.key: split_of("holdout:" + t.key) for t in self.traces}
        fit = tuple(t for t in self.traces if side[t.key] == "train")
        val = tuple(t for t in self.traces if side[t.key] == "test")
        return replace(self, traces=fit), replace(self, traces=val)

    def pairs(self, source: int, distance: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """All tokens' (layer source input, layer source+d input, layer source+d experts).

        -> x_source: [N, H] float32, x_target: [N, H] float32, idx_target: [N, k] long.
        """
        target = source + distance
        if not (0 <= source < self.num_layers and 0 <= target < self.num_layers):
            raise TraceError(f"layer {source} + distance {distance} is outside 0..{self.num_layers - 1}")
        if not self.traces:
            raise TraceError("no traces in this split; collect more prompts")
        x_source = torch.cat([t.hidden[source] for t in self.traces]).float()
        x_target = torch.cat([t.hidden[target] for t in self.traces]).float()
        idx = torch.cat([t.idx[target] for t in self.traces])
        return x_source, x_target, idx

    def channel_rms(self, layer: int) -> torch.Tensor:
        """Root mean square of every input channel of `layer`'s gate over all tokens: [H]."""
        if not self.traces:
            raise TraceError("no traces in this split; collect more prompts")
        squares = sum(t.hidden[layer].float().pow(2).sum(0) for t in self.traces)
        return (squares / self.num_tokens).sqrt()

    @property
    def num_tokens(self) -> int:
        return sum(t.num_tokens for t in self.traces)


def prompt_key(text: str) -> str:
    """A prompt's identity: the first 16 hex digits of the SHA-256 of its text."""
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def split_prompts(prompts: list[str]) -> list[tuple[str, str, str]]:
    """(key, split, text) per distinct prompt, in first-seen order; duplicates are dropped."""
    seen: dict[str, tuple[str, str, str]] = {}
    for text in prompts:
        key = prompt_key(text)
        if key not in seen:
            seen[key] = (key, split_of(key), text)
    return list(seen.values())


def save_traces(traces: RoutingTraces, path: str | Path) -> Path:
    """Write traces to one file (torch.save of plain tensors and metadata)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = {k: getattr(traces, k) for k in ("model_hash", "num_layers", "num_experts", "top_k", "hidden_size")}
    rows = [{"key": t.key, "split": t.split, "hidden": t.hidden, "idx": t.idx, "load": t.load, "trajectory": t.trajectory} for t in traces.traces]
    torch.save({"format": FORMAT, **meta, "traces": rows}, path)
    return path


def load_traces(path: str | Path, model_hash: str | None = None) -> RoutingTraces:
    """Read traces written by save_traces; with model_hash, insist they came from that model."""
    doc = torch.load(Path(path), weights_only=True)
    if doc.get("format") != FORMAT:
        raise TraceError(f"{path}: not a routing-trace file of format {FORMAT!r}; re-collect it")
    if model_hash is not None and doc["model_hash"] != model_hash:
        raise TraceError(f"{path}: traces of model {doc['model_hash']}, not of this model ({model_hash}); re-collect them")
    rows = tuple(PromptTrace(**row) for row in doc["traces"])
    meta = {k: doc[k] for k in ("model_hash", "num_layers", "num_experts", "top_k", "hidden_size")}
    return RoutingTraces(**meta, traces=rows)
