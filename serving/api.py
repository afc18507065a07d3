"""The OpenAI-style HTTP API as pure functions: request validation and response bodies.

Routes (served by moeless.serving.app): POST /v1/completions, POST /v1/chat/completions (both
with `"stream": true` as server-sent events), GET /v1/models, /healthz, /metrics.

Every bad request raises ApiError with an HTTP status and a message that says what was wrong
and what to send instead; `error_body` renders it in OpenAI's error format. Decoding is greedy
(the serving path's outputs must equal the reference forward), so options that would change
sampling are refused rather than silently ignored.
"""

from __future__ import annotations

import json
import time
import uuid
from dataclasses import dataclass
from typing import Any, Sequence

DEFAULT_COMPLETION_TOKENS = 16  # OpenAI's default for /v1/completions
DEFAULT_CHAT_TOKENS = 128
CHAT_ROLES = ("system", "user", "assistant")


class ApiError(Exception):
    """A request the server refuses: HTTP `status` and a message saying what to fix."""

    def __init__(self, status: int, message: str, *, param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code

    @property
    def kind(self) -> str:
        if self.status >= 500:
            return "server_error" if self.status != 503 else "service_unavailable"
        return "invalid_request_error"


def error_body(err: ApiError) -> dict[str, Any]:
    """OpenAI's error format: {"error": {"message", "type", "param", "code"}}."""
    return {"error": {"message": err.message, "type": err.kind, "param": err.param, "code": err.code}}


@dataclass(frozen=True)
class ChatMessage:
    role: str
    content: str


@dataclass(frozen=True)
class GenerationRequest:
    """One validated request. Exactly one of `prompt` (completions) and `messages` (chat) is set."""

    model: str
    max_tokens: int
    stream: bool
    prompt: str | None = None
    messages: tuple[ChatMessage, ...] | None = None

    @property
    def is_chat(self) -> bool:
        return self.messages is not None


def parse_json(body: bytes) -> dict[str, Any]:
    """The request body as a JSON object, or a 400 that says why it is not one."""
    try:
        doc = json.loads(body)
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise ApiError(400, f"the request body is not valid JSON ({err}); send a JSON object") from None
    if not isinstance(doc, dict):
        raise ApiError(400, f"the request body must be a JSON object, got a JSON {type(doc).__name__}")
    return doc


def parse_completion(doc: dict[str, Any], models: Sequence[str]) -> GenerationRequest:
    """Validate a /v1/completions body: {"model", "prompt": str, "max_tokens"?, "stream"?}."""
    model = _model(doc, models)
    prompt = doc.get("prompt")
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str):
        prompt = prompt[0]  # OpenAI clients may wrap a single prompt in a list
    if not isinstance(prompt, str):
        raise ApiError(400, f"'prompt' must be a string, got {_type_name(prompt)}; send one prompt per request",
                       param="prompt")
    if not prompt:
        raise ApiError(400, "'prompt' is empty; send at least one character", param="prompt")
    _refuse_sampling(doc, ("echo", "logprobs", "best_of", "suffix"))
    return GenerationRequest(model, _max_tokens(doc, DEFAULT_COMPLETION_TOKENS), _stream(doc), prompt=prompt)


def parse_chat(doc: dict[str, Any], models: Sequence[str]) -> GenerationRequest:
    """Validate a /v1/chat/completions body: {"model", "messages": [{"role", "content"}], ...}."""
    model = _model(doc, models)
    raw = doc.get("messages")
    if not isinstance(raw, list) or not raw:
        raise ApiError(400, f"'messages' must be a non-empty list of {{'role', 'content'}} objects, "
                            f"got {_type_name(raw)}", param="messages")
    messages = []
    for i, m in enumerate(raw):
        if not isinstance(m, dict):
            raise ApiError(400, f"messages[{i}] must be an object with 'role' and 'content', got {_type_name(m)}",
                           param=f"messages[{i}]")
        role, content = m.get("role"), m.get("content")
        if role not in CHAT_ROLES:
            raise ApiError(400, f"messages[{i}].role must be one of {list(CHAT_ROLES)}, got {role!r}",
                           param=f"messages[{i}].role")
        if not isinstance(content, str):
            raise ApiError(400, f"messages[{i}].content must be a string, got {_type_name(content)}",
                           param=f"messages[{i}].content")
        messages.append(ChatMessage(role, content))
    _refuse_sampling(doc, ("logprobs", "top_logprobs", "tools", "response_format"))
    tokens = _max_tokens(doc, DEFAULT_CHAT_TOKENS, names=("max_completion_tokens", "max_tokens"))
    return GenerationRequest(model, tokens, _stream(doc), messages=tuple(messages))


def check_context(prompt_tokens: int, max_tokens: int, limit: int) -> None:
    """A 400 unless the prompt plus the tokens to generate fit the model's context of `limit`."""
    if prompt_tokens + max_tokens > limit:
        raise ApiError(
            400,
            f"the prompt has {prompt_tokens} tokens and max_tokens is {max_tokens}, {prompt_tokens + max_tokens} "
            f"in all, over this model's context limit of {limit} tokens; shorten the prompt or lower max_tokens",
            param="prompt", code="context_length_exceeded",
        )


def _model(doc: dict[str, Any], models: Sequence[str]) -> str:
    model = doc.get("model")
    if not isinstance(model, str):
        raise ApiError(400, f"'model' must be a string naming a served model ({list(models)}), "
                            f"got {_type_name(model)}", param="model")
    if model not in models:
        raise ApiError(404, f"model {model!r} is not served here; use one of {list(models)} (GET /v1/models)",
                       param="model", code="model_not_found")
    return model


def _max_tokens(doc: dict[str, Any], default: int, names: tuple[str, ...] = ("max_tokens",)) -> int:
    for name in names:
        if doc.get(name) is None:
            continue
        value = doc[name]
        if isinstance(value, bool) or not isinstance(value, int):
            raise ApiError(400, f"'{name}' must be an integer, got {_type_name(value)}", param=name)
        if value < 1:
            raise ApiError(400, f"'{name}' must be at least 1, got {value}", param=name)
        return value
    return default


def _stream(doc: dict[str, Any]) -> bool:
    value = doc.get("stream", False)
    if value is None:
        return False
    if not isinstance(value, bool):
        raise ApiError(400, f"'stream' must be true or false, got {_type_name(value)}", param="stream")
    return value


def _refuse_sampling(doc: dict[str, Any], unsupported: tuple[str, ...]) -> None:
    """Greedy decoding only: refuse options that ask for something else instead of ignoring them."""
    temperature = doc.get("temperature")
    if temperature is not None:
        if isinstance(temperature, bool) or not isinstance(temperature, (int, float)):
            raise ApiError(400, f"'temperature' must be a number, got {_type_name(temperature)}", param="temperature")
        if temperature != 0:
            raise ApiError(400, f"this server decodes greedily; set 'temperature' to 0 or leave it out "
                                f"(got {temperature})", param="temperature")
    n = doc.get("n")
    if n is not None and n != 1:
        raise ApiError(400, f"'n' must be 1 (one completion per request), got {n!r}", param="n")
    for name in unsupported + ("stop",):
        value = doc.get(name)
        if value in (None, False, [], "") or (name == "best_of" and value == 1):
            continue
        raise ApiError(400, f"'{name}' is not supported by this server; leave it out", param=name)


def _type_name(value: Any) -> str:
    return "null" if value is None else f"a {type(value).__name__} ({json.dumps(value, default=str)[:40]})"


# ---- response bodies ----

def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict[str, int]:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def completion_body(req: GenerationRequest, rid: str, text: str, finish: str, prompt_tokens: int,
                    completion_tokens: int) -> dict[str, Any]:
    """The non-streaming response: "text_completion" or "chat.completion"."""
    if req.is_chat:
        choice = {"index": 0, "message": {"role": "assistant", "content": text}, "finish_reason": finish}
        kind = "chat.completion"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    return {"id": rid, "object": kind, "created": int(time.time()), "model": req.model, "choices": [choice],
            "usage": usage(prompt_tokens, completion_tokens)}


def chunk_body(req: GenerationRequest, rid: str, text: str, finish: str | None,
               usage: dict[str, int] | None = None) -> dict[str, Any]:
    """One streamed event: a piece of text (finish None) or the last event (text "", finish set,
    with the request's usage, as OpenAI sends it with stream_options.include_usage)."""
    if req.is_chat:
        delta = {"content": text} if text or finish is None else {}
        choice = {"index": 0, "delta": delta, "finish_reason": finish}
        kind = "chat.completion.chunk"
    else:
        choice = {"index": 0, "text": text, "logprobs": None, "finish_reason": finish}
        kind = "text_completion"
    body = {"id": rid, "object": kind, "created": int(time.time()), "model": req.model, "choices": [choice]}
    if usage is not None:
        body["usage"] = usage
    return body


def sse(doc: dict[str, Any] | str) -> str:
    """One server-sent event; the stream ends with sse("[DONE]")."""
    return f"data: {doc if isinstance(doc, str) else json.dumps(doc)}\n\n"
