"""Text <-> token ids for serving: the model's tokenizer, or characters for tokenizer-less test models.

The tiny test models (moeless.model.tiny) have a 128-token vocabulary and no tokenizer; the
CharCodec maps characters to their code points so the whole HTTP path runs on them too.
"""

from __future__ import annotations

from typing import Protocol, Sequence

from moeless.serving.api import ApiError, ChatMessage


class Codec(Protocol):
    eos_token_id: int | None

    def encode(self, text: str) -> list[int]: ...

    def decode(self, ids: Sequence[int]) -> str: ...

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> list[int]: ...


class TokenizerCodec:
    """A transformers tokenizer; chat prompts use its chat template when it has one."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        self.eos_token_id = tokenizer.eos_token_id

    def encode(self, text: str) -> list[int]:
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def decode(self, ids: Sequence[int]) -> str:
        return self.tokenizer.decode(list(ids), skip_special_tokens=True)

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        turns = [{"role": m.role, "content": m.content} for m in messages]
        if getattr(self.tokenizer, "chat_template", None):
            encoded = self.tokenizer.apply_chat_template(turns, add_generation_prompt=True, tokenize=True)
            return list(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)  # v5 returns a BatchEncoding
        return self.encode(_plain_chat(messages))


class CharCodec:
    """One token per character (code point < vocab_size); for test models without a tokenizer."""

    eos_token_id = None

    def __init__(self, vocab_size: int):
        self.vocab_size = vocab_size

    def encode(self, text: str) -> list[int]:
        bad = sorted({c for c in text if ord(c) >= self.vocab_size})
        if bad:
            raise ApiError(400, f"this test model reads only characters with code points below {self.vocab_size}; "
                                f"remove {''.join(bad[:10])!r}", param="prompt")
        return [ord(c) for c in text]

    def decode(self, ids: Sequence[int]) -> str:
        return "".join(chr(i) for i in ids)

    def chat_prompt(self, messages: Sequence[ChatMessage]) -> list[int]:
        return self.encode(_plain_chat(messages))


def _plain_chat(messages: Sequence[ChatMessage]) -> str:
    return "".join(f"{m.role}: {m.content}\n" for m in messages) + "assistant: "


def codec_for(model) -> Codec:
    """The model's tokenizer, else characters when the vocabulary is small enough (test models)."""
    if model.tokenizer is not None:
        return TokenizerCodec(model.tokenizer)
    if model.spec.vocab_size <= 1024:
        return CharCodec(model.spec.vocab_size)
    raise ValueError(f"model {model.spec.arch!r} has no tokenizer and a {model.spec.vocab_size}-token vocabulary; "
                     f"load it with its tokenizer to serve text")


class TextStream:
    """Turns generated ids into text pieces, holding back an incomplete multi-byte character."""

    def __init__(self, codec: Codec):
        self.codec = codec
        self.ids: list[int] = []
        self.sent = 0

    def push(self, token: int) -> str:
        self.ids.append(token)
        text = self.codec.decode(self.ids)
        if text.endswith("\ufffd"):
            return ""
        piece, self.sent = text[self.sent:], len(text)
        return piece
