"""Collect routing traces: run prompts through a MoEModel and record every layer's gate input
and decision (model.capture()), one prefill per prompt."""

from __future__ import annotations

from typing import Callable

import torch
from tqdm import tqdm

from moeless.model.default import padded_batches
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
def trace_batch(model, rows: list[tuple[str, str]], seqs: list[torch.Tensor], hidden_dtype: torch.dtype = torch.float16) -> list[PromptTrace]:
    """One prefill of prompts seqs (each [S_i], sorted by length) as a right-padded batch; one
    PromptTrace per prompt, from its own (unpadded) tokens. rows: (key, split) per prompt.

    hidden_dtype: how gate inputs are stored; float16 halves the memory and can flip near-tied
    top-k choices, float32 keeps them exact.
    """
    # Sorted by length, padded_batches keeps the given order within the one batch.
    ids, mask = next(padded_batches(seqs, len(seqs), pad_id=0))
    with model.capture() as capture:
        model.forward(ids, attention_mask=mask)
    records = capture.iterations[0]  # per layer; unpadded tokens, row after row
    lengths = [len(s) for s in seqs]
    per_layer = [(torch.split(r.gate_input, lengths), torch.split(r.idx, lengths)) for r in records]
    traces = []
    for b, (key, split) in enumerate(rows):
        hidden = torch.stack([x[b] for x, _ in per_layer])  # [L, T, H]
        idx = torch.stack([i[b] for _, i in per_layer])  # [L, T, k]
        probs = torch.stack([torch.softmax(model.gate(l)(hidden[l]), dim=-1).mean(0) for l in range(len(records))])
        load = torch.stack([torch.bincount(i.reshape(-1), minlength=model.spec.num_experts) for i in idx])
        traces.append(PromptTrace(key=key, split=split, hidden=hidden.to(hidden_dtype), idx=idx, load=load, trajectory=probs.float()))
    return traces


def collect_traces(
    model,
    prompts: list[str],
    tokenize: Callable[[str], torch.Tensor] | None = None,
    max_tokens: int = 128,
    hidden_dtype: torch.dtype = torch.float16,
    batch_size: int = 8,
    progress: bool = True,
) -> RoutingTraces:
    """Traces of the distinct prompts (in first-seen order), each on the side of the 70:30 split
    its text hashes to. Prompts of similar length run together, batch_size at a time.

    tokenize: text -> input_ids [1, S]; the model's tokenizer, cut to max_tokens, by default.
    """
    tokenize = tokenize or tokenizer_of(model, max_tokens)
    rows, seqs = [], []
    for key, split, text in split_prompts(prompts):
        ids = tokenize(text).reshape(-1)
        if len(ids):
            rows.append((key, split))
            seqs.append(ids)
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), i))
    traces: dict[int, PromptTrace] = {}
    with tqdm(total=len(seqs), desc="routing traces", unit="prompt", disable=not progress) as bar:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            for i, trace in zip(chunk, trace_batch(model, [rows[i] for i in chunk], [seqs[i] for i in chunk], hidden_dtype)):
                traces[i] = trace
            bar.update(len(chunk))
    spec = model.spec
    ordered = tuple(traces[i] for i in range(len(seqs)))
    return RoutingTraces(model_hash(model), spec.num_layers, spec.num_experts, spec.top_k, spec.hidden_size, ordered)
