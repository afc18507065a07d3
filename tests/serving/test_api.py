"""Request validation and response bodies of the OpenAI-style API (pure, no server)."""

import json

import pytest

from moeless.serving.api import (
    ApiError, check_context, chunk_body, completion_body, error_body, parse_chat, parse_completion, parse_json, sse,
)

MODELS = ["moeless-default"]


def _error(fn, *args) -> ApiError:
    with pytest.raises(ApiError) as info:
        fn(*args)
    return info.value


def test_valid_completion_and_chat():
    req = parse_completion({"model": "moeless-default", "prompt": "Hi", "max_tokens": 5, "stream": True}, MODELS)
    assert (req.prompt, req.max_tokens, req.stream, req.is_chat) == ("Hi", 5, True, False)
    chat = parse_chat({"model": "moeless-default", "messages": [{"role": "user", "content": "Hi"}],
                       "max_completion_tokens": 3, "temperature": 0}, MODELS)
    assert chat.is_chat and chat.messages[0].content == "Hi" and chat.max_tokens == 3 and not chat.stream


def test_single_prompt_in_a_list_is_accepted():
    assert parse_completion({"model": "moeless-default", "prompt": ["x"]}, MODELS).prompt == "x"


@pytest.mark.parametrize("body", [b"{not json", b"\xff\xfe", b"[1, 2]", b'"text"'])
def test_malformed_json_is_a_400(body):
    err = _error(parse_json, body)
    assert err.status == 400 and "JSON" in err.message


@pytest.mark.parametrize("doc, param, words", [
    ({"model": 3, "prompt": "x"}, "model", "must be a string"),
    ({"model": "moeless-default", "prompt": 7}, "prompt", "must be a string"),
    ({"model": "moeless-default", "prompt": ""}, "prompt", "empty"),
    ({"model": "moeless-default", "prompt": "x", "max_tokens": "5"}, "max_tokens", "integer"),
    ({"model": "moeless-default", "prompt": "x", "max_tokens": 2.5}, "max_tokens", "integer"),
    ({"model": "moeless-default", "prompt": "x", "max_tokens": True}, "max_tokens", "integer"),
    ({"model": "moeless-default", "prompt": "x", "max_tokens": -3}, "max_tokens", "at least 1"),
    ({"model": "moeless-default", "prompt": "x", "stream": "yes"}, "stream", "true or false"),
    ({"model": "moeless-default", "prompt": "x", "temperature": 0.7}, "temperature", "greedily"),
    ({"model": "moeless-default", "prompt": "x", "n": 2}, "n", "must be 1"),
    ({"model": "moeless-default", "prompt": "x", "stop": ["\n"]}, "stop", "not supported"),
])
def test_bad_completion_fields_are_400s_naming_the_field(doc, param, words):
    err = _error(parse_completion, doc, MODELS)
    assert err.status == 400 and err.param == param and words in err.message


def test_unknown_model_is_a_404_listing_served_models():
    err = _error(parse_completion, {"model": "gpt-4", "prompt": "x"}, MODELS)
    assert err.status == 404 and "moeless-default" in err.message and err.code == "model_not_found"


@pytest.mark.parametrize("messages, words", [
    (None, "non-empty list"),
    ([], "non-empty list"),
    (["hi"], "messages[0] must be an object"),
    ([{"role": "robot", "content": "x"}], "messages[0].role"),
    ([{"role": "user", "content": None}], "messages[0].content"),
])
def test_bad_chat_messages_are_400s(messages, words):
    err = _error(parse_chat, {"model": "moeless-default", "messages": messages}, MODELS)
    assert err.status == 400 and words in err.message


def test_context_limit():
    check_context(10, 6, 16)
    err = _error(check_context, 10, 7, 16)
    assert err.status == 400 and err.code == "context_length_exceeded" and "16" in err.message


def test_bodies_follow_openai_format():
    req = parse_chat({"model": "moeless-default", "messages": [{"role": "user", "content": "Hi"}]}, MODELS)
    body = completion_body(req, "id-1", "Hello", "length", 4, 2)
    assert body["object"] == "chat.completion" and body["choices"][0]["message"]["content"] == "Hello"
    assert body["usage"] == {"prompt_tokens": 4, "completion_tokens": 2, "total_tokens": 6}
    chunk = chunk_body(req, "id-1", "He", None)
    assert chunk["object"] == "chat.completion.chunk" and chunk["choices"][0]["delta"] == {"content": "He"}
    event = sse(chunk)
    assert event.startswith("data: ") and event.endswith("\n\n") and json.loads(event[6:])["id"] == "id-1"
    err = error_body(ApiError(503, "down"))
    assert err["error"]["type"] == "service_unavailable" and err["error"]["message"] == "down"
