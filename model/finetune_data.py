"""Task data of fine-tunes: the packaged datasets as packed token blocks, split train / test.

Tasks (no network; model/datasets.py reads the packages):
- "humaneval" (a code fine-tune): whole HumanEval programs, prompt and canonical solution, split
  70:30 by task id (118 train, 46 test programs);
- "sharegpt" (a chat fine-tune): the first user turn and the reply to it, in the tokenizer's chat
  template, split 70:30 by conversation id (the first 600 train / 200 test exchanges).

Texts are packed, not padded: each is cut to its first `max_text` tokens, ended with EOS, and
the stream is cut into full blocks of `block` tokens, so every position of a batch is a real
next-token prediction and a step's cost is fixed. The held-out perplexity sets (held_out) are a
task's test blocks and the model-quality bench's generic set (64 ShareGPT test prompts of 128
tokens, plain text: the docs/model.md perplexity of the default model).
"""

from __future__ import annotations

import torch

from moeless.model.datasets import humaneval_programs, sharegpt_exchanges, sharegpt_prompts
from moeless.model.default import encode_prompts

TASKS = ("humaneval", "sharegpt")
SHAREGPT_EXCHANGES = {"train": 600, "test": 200}
GENERIC = "sharegpt-prompts"  # the generic held-out set's name in reports


def task_texts(task: str, split: str, tokenizer) -> list[str]:
    """The texts of `task` ("humaneval" or "sharegpt") in `split` ("train" or "test")."""
    if task == "humaneval":
        return humaneval_programs(split)
    if task == "sharegpt":
        return [tokenizer.apply_chat_template([{"role": "user", "content": human}, {"role": "assistant", "content": reply}],
                                              tokenize=False)
                for human, reply in sharegpt_exchanges(SHAREGPT_EXCHANGES[split], split)]
    raise ValueError(f"unknown task {task!r}; known: {', '.join(TASKS)}")


def pack(tokenizer, texts: list[str], block: int, max_text: int = 512, max_blocks: int | None = None) -> torch.Tensor:
    """Texts packed into full blocks: each text's first max_text tokens and EOS, concatenated, cut
    into rows of `block` tokens (the incomplete tail dropped). -> [N, block] long."""
    stream: list[int] = []
    for text in texts:
        stream += tokenizer(text)["input_ids"][:max_text] + [tokenizer.eos_token_id]
        if max_blocks is not None and len(stream) >= max_blocks * block:
            break
    rows = len(stream) // block if max_blocks is None else min(len(stream) // block, max_blocks)
    if rows == 0:
        raise ValueError(f"{len(stream)} tokens do not fill one block of {block}")
    return torch.tensor(stream[: rows * block], dtype=torch.long).reshape(rows, block)


def train_blocks(task: str, tokenizer, block: int = 128) -> torch.Tensor:
    """The task's training split as packed blocks [N, block]."""
    return pack(tokenizer, task_texts(task, "train", tokenizer), block)


def held_out(tokenizer, block: int = 128, max_blocks: int = 24) -> dict[str, list[torch.Tensor]]:
    """The held-out perplexity sets, each a list of [S] token ids: every task's test split packed
    (at most max_blocks blocks: 3,072 tokens by default, as many as the generic set) and the generic prompts."""
    sets = {f"{task}-test": list(pack(tokenizer, task_texts(task, "test", tokenizer), block, max_blocks=max_blocks))
            for task in TASKS}
    sets[GENERIC] = encode_prompts(tokenizer, sharegpt_prompts(64, "test"), 128)
    return sets
