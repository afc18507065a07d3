"""Where the predictor commands get their model and traces: the default model (or a model
directory) and routing traces of ShareGPT and HumanEval prompts, cached by model fingerprint."""

from __future__ import annotations

import logging
from dataclasses import replace
from pathlib import Path

from moeless.core.paths import cache_dir
from moeless.model.datasets import humaneval_prompts, sharegpt_prompts
from moeless.model.default import default_model
from moeless.model.hf_loader import load_moe_model
from moeless.predictor.collect import collect_traces
from moeless.predictor.dataset import RoutingTraces, load_traces, save_traces
from moeless.predictor.fingerprint import model_hash

log = logging.getLogger(__name__)


def load_model(path: str | None):
    """The MoEModel in directory `path`, or the default model (built and cached on first use)."""
    if path:
        return load_moe_model(path)
    return default_model()


def traces_path(model, dataset: str, prompts: int, max_tokens: int) -> Path:
    return cache_dir() / "predictor" / f"traces-{model_hash(model)}-{dataset}-n{prompts}-t{max_tokens}.pt"


def dataset_traces(model, dataset: str, prompts: int, max_tokens: int, progress: bool = True) -> RoutingTraces:
    """Traces of the first `prompts` prompts of "sharegpt" (split 70:30 by prompt) or "humaneval"
    (all marked "test": a domain shift, never trained on); cached under the model's fingerprint."""
    path = traces_path(model, dataset, prompts, max_tokens)
    if path.is_file():
        return load_traces(path, model_hash=model_hash(model))
    if dataset == "sharegpt":
        traces = collect_traces(model, sharegpt_prompts(prompts), max_tokens=max_tokens, progress=progress)
    elif dataset == "humaneval":
        traces = collect_traces(model, humaneval_prompts(prompts), max_tokens=max_tokens, progress=progress)
        traces = replace(traces, traces=tuple(replace(t, split="test") for t in traces.traces))
    else:
        raise ValueError(f"unknown prompt dataset {dataset!r}; use 'sharegpt' or 'humaneval'")
    save_traces(traces, path)
    log.info("cached %d %s traces in %s", len(traces.traces), dataset, path)
    return traces
