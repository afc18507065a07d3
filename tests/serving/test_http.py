"""The HTTP API end to end: Ray Serve ingress, a model replica, three real expert-host processes."""

import json
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import numpy as np
import pytest

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.placement.types import LayerPlacement, Placement
from moeless.controller.planning.board import publish_placement

MODEL = "tiny-mixtral"
BOARD = "test-http-board"


@pytest.fixture(scope="module")
def url(ray_serve, hosts, deploy_tiny):
    deploy_tiny(hosts.addresses, MODEL, batch_wait_s=0.3, num_replicas=2, placement_board=BOARD)
    return ray_serve


def _post(url, path, doc=None, content=None):
    return httpx.post(url + path, json=doc, content=content, timeout=60)


def test_completion_equals_reference_generation(url, tiny_store, reference_text):
    model, _ = tiny_store
    r = _post(url, "/v1/completions", {"model": MODEL, "prompt": "The cat sat", "max_tokens": 7})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["object"] == "text_completion" and body["choices"][0]["finish_reason"] == "length"
    assert body["choices"][0]["text"] == reference_text(model, "The cat sat", 7)
    assert body["usage"] == {"prompt_tokens": 11, "completion_tokens": 7, "total_tokens": 18}


def test_streamed_chat_equals_unstreamed(url):
    doc = {"model": MODEL, "messages": [{"role": "user", "content": "Hello!"}], "max_tokens": 6}
    whole = _post(url, "/v1/chat/completions", doc).json()["choices"][0]["message"]["content"]
    r = _post(url, "/v1/chat/completions", {**doc, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    events = [line[6:] for line in r.text.split("\n\n") if line.startswith("data: ")]
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    assert all(c["object"] == "chat.completion.chunk" for c in chunks)
    assert "".join(c["choices"][0]["delta"].get("content", "") for c in chunks) == whole
    assert chunks[-1]["choices"][0]["finish_reason"] == "length"


def test_concurrent_requests_are_batched_and_each_exact(url, tiny_store, reference_text):
    model, _ = tiny_store
    prompts = [("a", 4), ("bcd efg", 6), ("Once upon a time", 3), ("xyz", 5)]
    with ThreadPoolExecutor(len(prompts)) as pool:
        replies = list(pool.map(lambda p: _post(url, "/v1/completions",
                                                {"model": MODEL, "prompt": p[0], "max_tokens": p[1]}), prompts))
    for (prompt, n), r in zip(prompts, replies):
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["text"] == reference_text(model, prompt, n)
    counts = _batch_histogram(httpx.get(url + "/metrics").text)
    assert counts[1.0] < counts[float("inf")], "no request was decoded in a batch of two or more"


def test_a_burst_of_streams_runs_as_one_batch_beyond_ray_serves_default_of_five(url):
    """The ingress holds each stream until its last token; with Ray Serve's default of 5 ongoing
    requests it capped every running batch at 5 (moeless bench load: 20 tokens/s instead of 54)."""
    before = _batch_histogram(httpx.get(url + "/metrics").text)
    assert before.get(8.0, 0) == before.get(float("inf"), 0)
    doc = {"model": MODEL, "prompt": "Once", "max_tokens": 150, "stream": True}
    with ThreadPoolExecutor(20) as pool:  # 20 streams over 2 replicas: one runs >= 10 at once
        replies = list(pool.map(lambda _: _post(url, "/v1/completions", doc), range(20)))
    assert all(r.status_code == 200 for r in replies), [r.text for r in replies if r.status_code != 200]
    after = _batch_histogram(httpx.get(url + "/metrics").text)
    assert after[8.0] < after[float("inf")], f"no request joined a batch of more than 8: {after}"


def _batch_histogram(metrics: str) -> dict[float, float]:
    """Cumulative counts of moeless_batch_size by bucket upper bound."""
    counts = {}
    for line in metrics.splitlines():
        if line.startswith("moeless_batch_size_bucket"):
            bound = line.split('le="')[1].split('"')[0]
            counts[float(bound)] = float(line.rsplit(" ", 1)[1])
    return counts


@pytest.mark.parametrize("path, doc, content, status, words", [
    ("/v1/completions", None, b'{"model": "tiny-mixtral", "prompt": ', 400, "not valid JSON"),
    ("/v1/completions", {"model": MODEL, "prompt": ["a", "b"]}, None, 400, "'prompt' must be a string"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": "ten"}, None, 400, "must be an integer"),
    ("/v1/completions", {"model": MODEL, "prompt": "hi", "max_tokens": -1}, None, 400, "at least 1"),
    ("/v1/completions", {"model": "gpt-4o", "prompt": "hi"}, None, 404, "not served here"),
    ("/v1/completions", {"model": MODEL, "prompt": "x" * 250, "max_tokens": 10}, None, 400, "context limit of 256"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": 5}]}, None, 400,
     "messages[0].content"),
    ("/v1/chat/completions", {"model": MODEL, "messages": [{"role": "user", "content": "x" * 300}], "stream": True},
     None, 400, "context limit"),
])
def test_bad_requests_get_4xx_saying_what_to_fix(url, path, doc, content, status, words):
    r = _post(url, path, doc, content)
    assert r.status_code == status, r.text
    assert words in r.json()["error"]["message"]


def test_models_health_and_metrics(url):
    assert httpx.get(url + "/v1/models").json()["data"][0]["id"] == MODEL
    health = httpx.get(url + "/healthz")
    assert health.status_code == 200 and health.json()["live_hosts"] == [0, 1, 2]
    _post(url, "/v1/completions", {"model": MODEL, "prompt": "metrics", "max_tokens": 2})
    metrics = httpx.get(url + "/metrics").text
    assert 'moeless_http_requests_total{route="completions",status="200"}' in metrics
    assert "moeless_generated_tokens_total" in metrics and "moeless_dead_expert_hosts 0.0" in metrics


def test_a_published_placement_reaches_every_replica(url, hosts, tiny_store, reference_text):
    model, _ = tiny_store
    spec = model.spec
    on_host_2 = LayerPlacement.even(np.arange(spec.num_experts), np.full(spec.num_experts, 2), spec.num_experts)
    publish_placement(Placement((on_host_2,) * spec.num_layers, spec.num_experts, 3), BOARD)
    time.sleep(0.5)  # replicas poll the board every 0.1 s
    clients = [ExpertHostClient(a) for a in hosts.addresses]
    before = [c.status()["meters"]["invocations"] for c in clients]
    prompts = [f"placement {i}" for i in range(6)]
    with ThreadPoolExecutor(3) as pool:
        replies = list(pool.map(lambda p: _post(url, "/v1/completions", {"model": MODEL, "prompt": p, "max_tokens": 3}),
                                prompts))
    assert [r.json()["choices"][0]["text"] for r in replies] == [reference_text(model, p, 3) for p in prompts]
    after = [c.status()["meters"]["invocations"] for c in clients]
    assert after[0] == before[0] and after[1] == before[1] and after[2] > before[2], (before, after)
    publish_placement(Placement.static(spec.num_layers, spec.num_experts, 3), BOARD)
    for c in clients:
        c.close()


def test_the_official_openai_client_gets_the_reference_completion_chat_and_stream(url, tiny_store, reference_text):
    import openai

    model, _ = tiny_store
    client = openai.OpenAI(base_url=url + "/v1", api_key="not-needed", max_retries=0, timeout=60)
    assert [m.id for m in client.models.list()] == [MODEL]
    completion = client.completions.create(model=MODEL, prompt="The cat sat", max_tokens=7, temperature=0)
    assert completion.choices[0].text == reference_text(model, "The cat sat", 7)
    assert completion.usage.completion_tokens == 7 and completion.choices[0].finish_reason == "length"
    chat = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5)
    stream = client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=5,
                                            stream=True)
    pieces = [chunk.choices[0].delta.content or "" for chunk in stream]
    assert "".join(pieces) == chat.choices[0].message.content
    with pytest.raises(openai.BadRequestError, match="temperature"):
        client.completions.create(model=MODEL, prompt="hi", max_tokens=2, temperature=0.7)
    with pytest.raises(openai.NotFoundError, match="not served here"):
        client.completions.create(model="gpt-4o", prompt="hi", max_tokens=2)


def test_load_generator_measures_each_request_of_a_replay_and_of_closed_loop_clients(url, tiny_store, reference_text):
    from moeless.serving.loadgen import closed_loop, replay, summarize

    model, _ = tiny_store
    prompts = [f"load {i}" for i in range(6)]
    outcomes = replay(url, MODEL, prompts, [0.0, 0.0, 0.1, 0.2, 0.2, 0.4], [3, 5, 4, 6, 2, 3])
    assert [o.text for o in outcomes] == [reference_text(model, p, n) for p, n in zip(prompts, [3, 5, 4, 6, 2, 3])]
    assert [o.completion_tokens for o in outcomes] == [3, 5, 4, 6, 2, 3] and outcomes[3].arrival_s == 0.2
    for o in outcomes:
        assert o.error is None and o.status == 200 and 0 < o.ttft_s <= o.end_s - o.arrival_s and o.tpot_s >= 0
    looped = closed_loop(url, MODEL, prompts, clients=2, max_tokens=4)
    assert [o.index for o in looped] == list(range(6))
    assert [o.text for o in looped] == [reference_text(model, p, 4) for p in prompts]
    figures = summarize(looped + [replay(url, "no-such-model", ["x"], [0.0], 2)[0]])
    assert figures["succeeded"] == 6 and figures["failed"] == 1 and "not served here" in figures["errors"][0]
    assert figures["completion_tokens"] == 24 and figures["tokens_per_s"] > 0
    assert 0 < figures["ttft_s"]["p50"] <= figures["ttft_s"]["p99"]


def test_metrics_show_the_data_path_to_each_host(url):
    assert _post(url, "/v1/completions", {"model": MODEL, "prompt": "Hi", "max_tokens": 2}).status_code == 200
    lines = [line for line in httpx.get(url + "/metrics").text.splitlines() if line.startswith("moeless_expert_host_path{")]
    slots = sorted(line.split('slot="')[1].split('"')[0] for line in lines if line.endswith(" 1.0"))
    # hosts on this machine: shared memory, once the replica that answers /metrics has called them
    assert slots == ["0", "1", "2"] and all('path="local"' in line or 'path="unopened"' in line for line in lines), lines
