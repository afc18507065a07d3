"""Routing recorded by running a model: an HF MoE checkpoint (`moeless trace record`), or the
default model rebuilt at a geometry's (E, k) ("moefied SmolLM2 routing at E=.., k=..": a
stand-in where no recorded trace exists, never the real model's routing; cached).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from moeless.core.paths import cache_dir
from moeless.core.threads import torch_threads
from moeless.model.datasets import humaneval_prompts, sharegpt_prompts
from moeless.model.default import BuildConfig, build
from moeless.model.hf_loader import load_moe_model
from moeless.traces.request_loads import token_picks
from moeless.traces.routing_file import Routing, RoutingError, load_routing, save_routing

PROMPT_SETS = ("sharegpt", "humaneval")


def moefied_label(num_experts: int, top_k: int) -> str:
    """The label every report carries for moefied routing."""
    return f"moefied SmolLM2 routing at E={num_experts}, k={top_k}"


def prompts_of(name: str, count: int) -> list[str]:
    """`count` prompts of a packaged set: sharegpt (test split) or humaneval."""
    if name not in PROMPT_SETS:
        raise RoutingError(f"unknown prompts {name!r}; use one of {', '.join(PROMPT_SETS)}")
    return sharegpt_prompts(count, split="test") if name == "sharegpt" else humaneval_prompts(count)


def record_routing(model, prompts: list, new_tokens: int, label: str, max_prompt_tokens: int = 512,
                   progress: bool = False) -> Routing:
    """Greedy-generate every prompt through `model` (a MoEModel) and keep each token's expert ids.
    Without a tokenizer, text prompts become their UTF-8 bytes (mod the vocabulary), said in the label."""
    if model.tokenizer is None:
        prompts = [[b % model.spec.vocab_size for b in p.encode()] if isinstance(p, str) else p for p in prompts]
        label += " (no tokenizer: prompts as UTF-8 bytes)"
    picks = token_picks(model, prompts, new_tokens, max_prompt_tokens, stop_at_eos=False, progress=progress)
    topk = np.concatenate([np.concatenate([p, d]) for p, d in picks])
    lengths = np.array([len(p) + len(d) for p, d in picks])
    return Routing(topk, lengths, np.array([len(p) for p, _ in picks]), model.spec.num_experts, label)


def record_checkpoint(model_dir: str | Path, prompts: str, count: int, new_tokens: int, device: str = "auto",
                      progress: bool = True) -> Routing:
    """Routing of the HF MoE checkpoint in `model_dir` on `count` prompts of `prompts`, on the GPU
    when there is one (device "auto") or on `device`."""
    import torch

    model = load_moe_model(model_dir)
    where = ("cuda" if torch.cuda.is_available() else "cpu") if device == "auto" else device
    model.to(where)
    label = f"recorded routing of {Path(model_dir).name} on {count} {prompts} prompts ({where})"
    return record_routing(model, prompts_of(prompts, count), new_tokens, label, progress=progress)


def moefied_routing(num_experts: int, top_k: int, prompts: str, count: int, new_tokens: int,
                    max_prompt_tokens: int = 256, progress: bool = True) -> tuple[Routing, Path]:
    """The default model rebuilt at (E, k) routes `count` prompts; cached by every argument.
    Building a model takes minutes the first time (`moeless model build --experts E --top-k K`)."""
    path = cache_dir() / "routing" / f"moefied-e{num_experts}-k{top_k}-{prompts}-n{count}-t{new_tokens}-p{max_prompt_tokens}.npz"
    if path.is_file():
        return load_routing(path), path
    try:
        config = BuildConfig(num_experts, top_k, 0)
    except ValueError as err:
        raise RoutingError(f"no moefied routing at E={num_experts}, k={top_k}: {err}") from None
    with torch_threads(1):
        model = load_moe_model(build(config, progress=progress))
        routing = record_routing(model, prompts_of(prompts, count), new_tokens, moefied_label(num_experts, top_k),
                                 max_prompt_tokens, progress)
    return routing, save_routing(path, routing)
