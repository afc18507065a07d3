"""Real routing traces for benchmarks: tokens per expert of every request, prefill and decode
(`token_picks`: each token's expert ids, for the routing file, traces/routing_file.py).

Each request (one prompt) is a prefill over the prompt, then greedy decode steps, each feeding
one generated token. Requests run in batches for speed, but each request's loads count only its
own tokens. Saved as one .npz: prefill [N, L, E], the decode rows of all requests concatenated
[sum S_i, L, E], and per-request decode lengths and prompt lengths.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import torch
import torch.nn.functional as F
from tqdm import tqdm

from moeless.model.batching import left_pad
from moeless.model.moe_model import MoEModel


@dataclass(frozen=True)
class RequestLoads:
    """Routing loads of one request.

    prefill: [L, E] int, tokens per expert for the prompt (summing to prompt_tokens * k per layer);
    decode: [S, L, E] int, row s = the decode step that feeds generated token s (k per layer).
    """

    prefill: np.ndarray
    decode: np.ndarray
    prompt_tokens: int


class TraceError(ValueError):
    """Bad trace inputs or a damaged trace file."""


def _prompt_ids(model: MoEModel, prompt: str | Sequence[int] | torch.Tensor, max_prompt_tokens: int) -> list[int]:
    """One prompt as token ids (text is encoded plainly with the model's tokenizer, no chat template)."""
    if isinstance(prompt, str):
        if model.tokenizer is None:
            raise TraceError(f"model {model.spec.arch!r} has no tokenizer: pass prompts as token ids")
        ids = model.tokenizer(prompt)["input_ids"]
    else:
        ids = torch.as_tensor(prompt).reshape(-1).tolist()
    if not ids:
        raise TraceError("an empty prompt has no tokens to route")
    return ids[:max_prompt_tokens]


def request_loads(
    model: MoEModel,
    prompts: Sequence[str | Sequence[int] | torch.Tensor],
    max_new_tokens: int,
    max_prompt_tokens: int = 512,
    stop_at_eos: bool = True,
    batch_size: int = 8,
    progress: bool = False,
) -> list[RequestLoads]:
    """Greedy-generate for each prompt and record its loads: one RequestLoads per prompt, in order.

    Every request has max_new_tokens decode rows unless it reaches the tokenizer's EOS first
    (stop_at_eos); an EOS token is not fed back, so it has no decode row. Prompts of similar
    length run together, left-padded, batch_size at a time (padding is masked out of the loads).
    """
    E = model.spec.num_experts
    picks = token_picks(model, prompts, max_new_tokens, max_prompt_tokens, stop_at_eos, batch_size, progress)
    return [RequestLoads(prefill=_counts(p, E).sum(0), decode=_counts(d, E), prompt_tokens=len(p)) for p, d in picks]


def token_picks(
    model: MoEModel,
    prompts: Sequence[str | Sequence[int] | torch.Tensor],
    max_new_tokens: int,
    max_prompt_tokens: int = 512,
    stop_at_eos: bool = True,
    batch_size: int = 8,
    progress: bool = False,
) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per prompt, in order, the expert ids each token was routed to: (prompt [P, L, k], decode
    [S, L, k], row s = the decode step feeding generated token s); generation as request_loads."""
    if max_new_tokens < 0 or batch_size < 1:
        raise TraceError(f"need max_new_tokens >= 0 and batch_size >= 1, got {max_new_tokens}, {batch_size}")
    eos = getattr(model.tokenizer, "eos_token_id", None) if stop_at_eos else None
    seqs = [_prompt_ids(model, p, max_prompt_tokens) for p in prompts]
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), i))
    result: dict[int, tuple[np.ndarray, np.ndarray]] = {}
    with tqdm(total=len(seqs), desc="routing traces", disable=not progress) as bar:
        for start in range(0, len(order), batch_size):
            chunk = order[start : start + batch_size]
            for i, picks in zip(chunk, _batch_picks(model, [seqs[i] for i in chunk], max_new_tokens, eos)):
                result[i] = picks
            bar.update(len(chunk))
    return [result[i] for i in range(len(seqs))]


def _counts(picks: np.ndarray, num_experts: int) -> np.ndarray:
    """[T, L, k] expert ids -> [T, L, E] tokens per expert."""
    return F.one_hot(torch.as_tensor(picks), num_experts).sum(2).numpy().astype(np.int64)


def _batch_picks(model: MoEModel, seqs: list[list[int]], max_new_tokens: int, eos: int | None) -> list[tuple[np.ndarray, np.ndarray]]:
    """Expert ids of one batch of prompts, generated together: per prompt (prompt [P, L, k], decode [S, L, k])."""
    # 1. Left-pad to ids, mask: [B, S].
    ids, mask = left_pad(seqs)
    # 2. Generate one extra token, so that the last of max_new_tokens is fed back too.
    device = model.hf.device
    with model.capture() as capture:
        out = model.generate(ids.to(device), max_new_tokens + 1, attention_mask=mask.to(device), eos_token_id=eos)

    # 3. Per call, each unpadded token's picks per layer: [T, L, k] (T runs row by row).
    def picks(call: int) -> torch.Tensor:
        return torch.stack([r.idx for r in capture.iterations[call]], dim=1).cpu()

    prefill = torch.split(picks(0), [len(s) for s in seqs])
    calls = range(1, len(capture.iterations))
    k = prefill[0].shape[-1]
    no_calls = torch.zeros((0, len(seqs), model.spec.num_layers, k), dtype=torch.long)
    decode = torch.stack([picks(c) for c in calls]) if calls else no_calls  # [calls, B, L, k]
    result = []
    for b in range(len(seqs)):
        generated = out[b, ids.shape[1]:].tolist()
        steps = generated.index(eos) if eos in generated else max_new_tokens
        result.append((prefill[b].numpy().astype(np.int64), decode[:steps, b].numpy().astype(np.int64)))
    return result


def save_request_loads(path: str | Path, requests: Sequence[RequestLoads]) -> Path:
    """Write requests to one .npz file (see the module docstring); returns the path."""
    if not requests:
        raise TraceError("no requests to save")
    shape = requests[0].prefill.shape
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    np.savez_compressed(
        path,
        prefill=np.stack([r.prefill for r in requests]),
        decode=np.concatenate([r.decode.reshape(-1, *shape) for r in requests]),
        decode_len=np.array([len(r.decode) for r in requests], dtype=np.int64),
        prompt_tokens=np.array([r.prompt_tokens for r in requests], dtype=np.int64),
    )
    return path


def load_request_loads(path: str | Path) -> list[RequestLoads]:
    """Read a file written by save_request_loads."""
    path = Path(path)
    if not path.is_file():
        raise TraceError(f"{path}: no such trace file; record one with request_loads() and save_request_loads()")
    try:
        with np.load(path) as f:
            prefill, decode, decode_len, prompt_tokens = (f[k] for k in ("prefill", "decode", "decode_len", "prompt_tokens"))
    except (KeyError, ValueError, OSError) as err:
        raise TraceError(f"{path}: not a routing trace file ({err})") from err
    if decode_len.sum() != len(decode) or len(decode_len) != len(prefill):
        raise TraceError(
            f"{path}: inconsistent trace ({len(prefill)} requests, {len(decode)} decode rows, lengths sum {decode_len.sum()})"
        )
    starts = np.concatenate([[0], np.cumsum(decode_len)])
    return [
        RequestLoads(prefill=prefill[i], decode=decode[starts[i] : starts[i + 1]], prompt_tokens=int(prompt_tokens[i]))
        for i in range(len(prefill))
    ]
