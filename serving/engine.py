"""Greedy generation over a MoEModel whose routed experts run through an executor.

Two ways to batch. Continuous batching (moeless.serving.scheduler) calls the iteration-level
primitives: `prefill(prompts)` (newcomers packed into one row, no padding: their first tokens
and KV) and `decode(slots, tokens)` (one token for every running request, its KV in KVSlots).
Continuous batching's forwards can run as micro-batches in flight together (`micro_batches`,
serving/pingpong.py): while one's expert calls are on the hosts, the other computes; a forward
is split only when each part gets `micro_batch_tokens` tokens (a prefill: splitting a small decode
step doubles the replica's per-forward cost and the calls' fixed costs, measured in `moeless bench
serve`). Static batching, kept as the baseline of `moeless bench load`, is `Engine.run(requests)`: one
left-padded batch decoded to its longest request. Both use position ids from each row's own
length, so a row computes what it would alone. `run` yields, once per decoding step, a list
of events for every request (the scheduler sends the same events):

    {"text": str}                                               a piece of generated text
    {"finish": "stop"|"length", "prompt_tokens", "completion_tokens"}   the request is done
    {"error": {"status", "message", "code", "param"}}           the request failed

Events are plain dicts so they cross Ray process boundaries unchanged.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from functools import partial
from typing import Iterator, Sequence

import torch
from torch import nn

from moeless.expert_fn.errors import ReplicaLoadError
from moeless.model.batching import left_pad
from moeless.model.interface import ExpertExecutor
from moeless.serving.api import ApiError, GenerationRequest, check_context
from moeless.serving.codec import Codec, TextStream, codec_for
from moeless.serving.family import token_owners
from moeless.serving.kv_slots import KVSlots
from moeless.serving.pingpong import check_split, run_micro_batches, split_by_weight, split_rows
from moeless.controller.pool.members import NoLiveHostError


def error_event(err: Exception) -> dict:
    """The event (and HTTP status) a failure becomes."""
    if isinstance(err, ApiError):
        return {"error": {"status": err.status, "message": err.message, "code": err.code, "param": err.param}}
    if isinstance(err, NoLiveHostError):
        status, message, code = 503, f"no expert host can serve this request: {err}", "no_expert_host"
    elif isinstance(err, ReplicaLoadError):
        status, message, code = 500, f"an expert replica failed to load: {err}", "replica_load_failed"
    else:
        status, message, code = 500, f"internal error: {type(err).__name__}: {err}", None
    return {"error": {"status": status, "message": message, "code": code, "param": None}}


class Engine:
    """Tokenises, checks the context limit and decodes greedily; `executor` runs the experts."""

    def __init__(self, model, executor: ExpertExecutor | None = None, codec: Codec | None = None,
                 micro_batches: int = 1, micro_batch_tokens: int = 256, members: Sequence[str] = ()):
        check_split(micro_batches, micro_batch_tokens)
        self.model = model
        self.executor = executor
        # A base and its ESFT fine-tunes in one engine (serving/family.py): the served names, the base's
        # first; each forward tells the executor which member each token is (family.token_owners).
        self.members = list(members)
        self.codec = codec or codec_for(model)
        # Continuous batching's forwards of at least micro_batches x micro_batch_tokens tokens are
        # split into micro_batches, in flight together (pingpong.py); smaller ones are not.
        self.micro_batches, self.micro_batch_tokens = micro_batches, micro_batch_tokens
        self.split_forwards = 0  # forwards run as micro-batches (Prometheus: moeless_split_forwards)
        _LastPositionHead.install(model.hf)

    @property
    def context_limit(self) -> int:
        return self.model.spec.max_positions

    def encode(self, req: GenerationRequest) -> list[int]:
        """The prompt's token ids; ApiError 400 when it does not fit the context with max_tokens."""
        ids = self.codec.chat_prompt(req.messages) if req.is_chat else self.codec.encode(req.prompt)
        if not ids:
            raise ApiError(400, "the prompt encodes to no tokens; send some text", param="prompt")
        check_context(len(ids), req.max_tokens, self.context_limit)
        return ids

    def run(self, requests: Sequence[GenerationRequest]) -> Iterator[list[list[dict]]]:
        """Events per step for each request (see the module docstring); ends when all are done."""
        events: list[list[dict]] = [[] for _ in requests]
        prompts: dict[int, list[int]] = {}
        for i, req in enumerate(requests):
            try:
                prompts[i] = self.encode(req)
            except ApiError as err:
                events[i].append(error_event(err))
        if not prompts:
            yield events
            return
        rows = sorted(prompts)
        streams = {i: TextStream(self.codec) for i in rows}
        try:
            for step, tokens in enumerate(self.token_steps([prompts[i] for i in rows],
                                                           [requests[i].max_tokens for i in rows])):
                for i, token in zip(rows, tokens):
                    if token is None:
                        continue
                    finish = self.finish_reason(token, step + 1, requests[i].max_tokens)
                    if finish != "stop":
                        piece = streams[i].push(token)
                        if piece:
                            events[i].append({"text": piece})
                    if finish:
                        events[i].append({"finish": finish, "prompt_tokens": len(prompts[i]),
                                          "completion_tokens": len(streams[i].ids)})
                yield events
                events = [[] for _ in requests]
        except Exception as err:  # a failed forward fails every request of the batch
            yield [evs + [error_event(err)] if i in prompts else evs for i, evs in enumerate(events)]

    def owner(self, model: str) -> int:
        """The family member a request for `model` belongs to (0: the base, or an engine of one model)."""
        return self.members.index(model) if model in self.members else 0

    def prefill(self, prompts: Sequence[list[int]], owners: Sequence[int] | None = None
                ) -> tuple[list[int], list[tuple[object, int]]]:
        """New prompts' first tokens, and per prompt (the cache holding its KV in row 0, where its
        columns start there). The prompts are packed into one row (or one per micro-batch: groups
        of near-equal tokens). owners: each prompt's family member (None: all the base's)."""
        groups = split_by_weight([len(p) for p in prompts], self._parts(sum(len(p) for p in prompts)))
        tokens: list[int] = []
        kv: list[tuple[object, int]] = []
        for first, cache, starts in self._run([partial(self._prefill_packed, prompts[g.start:g.stop],
                                                       None if owners is None else owners[g.start:g.stop])
                                               for g in groups]):
            tokens += first
            kv += [(cache, start) for start in starts]
        return tokens, kv

    def _parts(self, tokens: int) -> int:
        """Micro-batches for a forward of `tokens` tokens: each must have micro_batch_tokens."""
        return self.micro_batches if tokens >= self.micro_batches * self.micro_batch_tokens else 1

    def _run(self, work: list) -> list:
        """The forward's micro-batches (pingpong.run_micro_batches), counting the forwards that split."""
        self.split_forwards += len(work) > 1
        return run_micro_batches(work)

    @torch.no_grad()
    def _prefill_packed(self, prompts: Sequence[list[int]], owners: Sequence[int] | None = None
                        ) -> tuple[list[int], object, list[int]]:
        """One forward over prompts packed into one row (no padding: a block-diagonal causal
        mask keeps each prompt to itself, positions restart at 0 for each): (each prompt's first
        token, the cache, where each prompt's columns start in it). The LM head runs on each
        prompt's last position only."""
        lengths = [len(p) for p in prompts]
        starts = [0]
        for length in lengths[:-1]:
            starts.append(starts[-1] + length)
        ids = torch.tensor([[t for p in prompts for t in p]])
        positions = torch.cat([torch.arange(n) for n in lengths]).unsqueeze(0)
        tokens_of = None if owners is None else [o for o, n in zip(owners, lengths) for _ in range(n)]
        with _LastPositionHead.only([s + n - 1 for s, n in zip(starts, lengths)]), token_owners(tokens_of):
            out = self.model.forward(ids, _block_causal_mask(lengths), None, use_cache=True, executor=self.executor,
                                     position_ids=positions)
        return out.logits[0].argmax(-1).tolist(), out.past_key_values, starts

    def decode(self, slots: KVSlots, tokens: Sequence[int], owners: Sequence[int] | None = None) -> list[int]:
        """One forward for every row of `slots` (or one per micro-batch of rows): tokens[r] is row
        r's input, at position = its cache length; returns each row's next token. The rows' KV
        grow by one column. owners: each row's family member (None: all the base's)."""
        groups = split_rows(len(tokens), self._parts(len(tokens)))
        inputs = [slots.decode_inputs(rows) for rows in groups]  # here: room for the new column is made once
        out = self._run([partial(self._decode_rows, slots, rows, cache, mask, tokens, owners)
                         for rows, (cache, mask) in zip(groups, inputs)])
        slots.advance()
        return [token for part in out for token in part]

    @torch.no_grad()
    def _decode_rows(self, slots: KVSlots, rows: range, cache, mask: torch.Tensor, tokens: Sequence[int],
                     owners: Sequence[int] | None = None) -> list[int]:
        positions = torch.tensor([[slots.end - slots.start[r]] for r in rows])
        ids = torch.tensor([tokens[r] for r in rows]).unsqueeze(1)
        with token_owners(None if owners is None else [owners[r] for r in rows]):
            out = self.model.forward(ids, mask, cache, use_cache=True, executor=self.executor, position_ids=positions)
        return out.logits[:, -1].argmax(-1).tolist()

    def finish_reason(self, token: int, generated: int, max_tokens: int) -> str | None:
        """"stop" at EOS, "length" once max_tokens are generated, else None."""
        if token == self.codec.eos_token_id:
            return "stop"
        return "length" if generated >= max_tokens else None

    @torch.no_grad()
    def token_steps(self, prompts: Sequence[list[int]], max_tokens: Sequence[int]) -> Iterator[list[int | None]]:
        """Greedy decoding of a batch: per step the new token of each row, None once a row is done
        (it produced EOS or max_tokens tokens)."""
        # 1. Left-pad to one [B, S] batch; the mask hides the pads, positions count real tokens only.
        ids, mask = left_pad(prompts)
        mask = mask.to(self.model.device)  # grows by the step's tokens, which the forward leaves there
        done = [False] * len(prompts)
        step_ids, cache = ids, None
        for step in range(max(max_tokens)):
            # 2. One forward call per step (prefill first, then one token per row with the KV cache).
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            with _LastPositionHead.only():
                out = self.model.forward(step_ids, mask, cache, use_cache=True, executor=self.executor,
                                         position_ids=positions)
            step_ids, cache = out.logits[:, -1].argmax(-1, keepdim=True), out.past_key_values
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
            # 3. Report each live row's token; a row ends at EOS or its own max_tokens.
            tokens: list[int | None] = []
            for b, token in enumerate(step_ids[:, 0].tolist()):
                tokens.append(None if done[b] else token)
                done[b] = done[b] or token == self.codec.eos_token_id or step + 1 >= max_tokens[b]
            yield tokens
            if all(done):
                return


def _block_causal_mask(lengths: Sequence[int]) -> torch.Tensor:
    """Additive attention mask [1, 1, S, S] for prompts packed back to back: each position sees
    the positions of its own prompt up to itself (0), nothing else (the dtype's minimum)."""
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths))
    pos = torch.arange(seq.numel())
    allowed = (seq[:, None] == seq[None, :]) & (pos[:, None] >= pos[None, :])
    return torch.where(allowed, 0.0, torch.finfo(torch.float32).min)[None, None]


class _LastPositionHead:
    """The LM head, computing only the positions that need logits while `only()` is on in this
    thread: the last one of a left-padded batch, or the given ones of a packed row.

    A prefill needs the logits of each prompt's last position; the full head costs a [S, V]
    product per row (on the default model 28 M multiply-adds per token, more than the rest of
    the forward). MoEModel.forward takes no logits_to_keep, so a forward pre-hook on the head
    cuts its input: the model's modules and state_dict stay as they were (the predictor's
    model_hash reads them).
    """

    _local = threading.local()

    @classmethod
    def install(cls, hf: nn.Module) -> None:
        head = hf.lm_head
        if not getattr(head, "_moeless_positions_hook", False):
            head.register_forward_pre_hook(cls._cut)
            head._moeless_positions_hook = True

    @classmethod
    def _cut(cls, head: nn.Module, args: tuple) -> tuple | None:
        """hidden [B, S, H] -> under only(): [B, 1, H] (the last position) or [B, P, H] (the P given)."""
        keep = getattr(cls._local, "keep", None)
        if keep is None:
            return None
        hidden = args[0]
        return (hidden[:, -1:] if keep == "last" else hidden[:, keep], *args[1:])

    @classmethod
    @contextmanager
    def only(cls, positions: list[int] | None = None):
        cls._local.keep = "last" if positions is None else positions
        try:
            yield
        finally:
            cls._local.keep = None
