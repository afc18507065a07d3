"""The Engine as the live loop runs it: it tells its LiveExecutor (serving/live_executor.py) the
phase of every forward, a prefill or a decode step, which the executor's iteration reports carry."""

from __future__ import annotations

from typing import Iterator, Sequence

from moeless.serving.engine import Engine


class LiveEngine(Engine):
    """The Engine, telling its LiveExecutor the phase of every forward (prefill or decode)."""

    def prefill(self, prompts: Sequence[list[int]], owners: Sequence[int] | None = None):
        self.executor.phase = "prefill"
        return super().prefill(prompts, owners)

    def decode(self, slots, tokens: Sequence[int], owners: Sequence[int] | None = None) -> list[int]:
        self.executor.phase = "decode"
        return super().decode(slots, tokens, owners)

    def token_steps(self, prompts: Sequence[list[int]], max_tokens: Sequence[int]) -> Iterator[list[int | None]]:
        """Static batches: the first step is the prefill, the rest decode."""
        self.executor.phase = "prefill"
        for tokens in super().token_steps(prompts, max_tokens):
            yield tokens
            self.executor.phase = "decode"
