"""Collect routing traces: run prompts through a MoEModel and record every layer's gate input
and decision (model.capture()), one prefill per prompt."""

from __future__ import annotations

from typing import Callable

import torch
from tqdm import tqdm

from moeless.predictor.dataset import PromptTrace, RoutingTraces, split_prompts
from moeless.predictor.fingerprint import model_hash


def tokenizer_of(model, max_tokens: int) -> Callable[[str], torch.Tensor]:
    """text -> input_ids [1, S <= max_tokens] with the model's own tokenizer."""
    if model.tokenizer is None:
        raise ValueError("this model has no tokenizer; pass tokenize= to collect_traces")

    def tokenize(text: str) -> torch.Tensor:
        return model.tokenizer(text, return_tensors="pt").input_ids[:, :max_tokens]

    return tokenize


@torch.no_grad()
def trace_prompt(model, key: str, split: str, input_ids: torch.Tensor, hidden_dtype: torch.dtype = torch.float16) -> PromptTrace:
    """One prefill of input_ids [1, S] through `model`, recorded as a PromptTrace.

    hidden_dtype: how gate inputs are stored; float16 halves the memory and can flip near-tied
    top-k choices, float32 keeps them exact.
    """
    with model.capture() as capture:
        model(input_ids)
    records = capture.iterations[0]
    trajectory = torch.stack([torch.softmax(model.gate(l)(r.gate_input), dim=-1).mean(0) for l, r in enumerate(records)])
    return PromptTrace(
        key=key,
        split=split,
        hidden=torch.stack([r.gate_input for r in records]).to(hidden_dtype),  # [L, T, H]
        idx=torch.stack([r.idx for r in records]),
        load=torch.stack([r.load for r in records]),
        trajectory=trajectory.float(),
    )


def collect_traces(
    model,
    prompts: list[str],
    tokenize: Callable[[str], torch.Tensor] | None = None,
    max_tokens: int = 128,
    hidden_dtype: torch.dtype = torch.float16,
    progress: bool = True,
) -> RoutingTraces:
    """Traces of the distinct prompts, each on the side of the 70:30 split its text hashes to.

    tokenize: text -> input_ids [1, S]; the model's tokenizer, cut to max_tokens, by default.
    """
    tokenize = tokenize or tokenizer_of(model, max_tokens)
    traces = []
    for key, split, text in tqdm(split_prompts(prompts), desc="routing traces", unit="prompt", disable=not progress):
        ids = tokenize(text)
        if ids.shape[1] == 0:
            continue
        traces.append(trace_prompt(model, key, split, ids, hidden_dtype))
    spec = model.spec
    return RoutingTraces(model_hash(model), spec.num_layers, spec.num_experts, spec.top_k, spec.hidden_size, tuple(traces))
