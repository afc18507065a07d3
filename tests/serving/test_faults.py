"""Faults with real processes: SIGKILL an expert host in the middle of a stream of requests, restart
it, kill them all (a clear 503, no hang), and a corrupt expert weight file."""

import json
import shutil
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import httpx
import pytest
import torch

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.experts import expert_forward
from moeless.serving.api import GenerationRequest
from moeless.serving.engine import Engine
from moeless.serving.executor import RemoteExecutor
from moeless.serving.placement_source import PlacementSource

MODEL = "tiny-mixtral"


@pytest.fixture(scope="module")
def cluster(tiny_store, ray_serve, deploy_tiny):
    _, root = tiny_store
    with launch_local_hosts(3, root, keep_alive_s=60, metrics=False) as group:
        deploy_tiny(group.addresses, MODEL, batch_wait_s=0.01)
        yield ray_serve, group


def _complete(url, prompt, n, timeout=60):
    return httpx.post(url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": n},
                      timeout=timeout)


def _stats():
    from ray import serve

    return serve.get_deployment_handle("ModelServer", "moeless").stats.remote().result()


def test_sigkill_mid_stream_every_request_completes_exactly(cluster, tiny_store, reference_text):
    url, group = cluster
    model, _ = tiny_store
    prompts = [(f"request {i}", 6 + i % 3) for i in range(8)]
    pieces, killed = [], threading.Event()
    with ThreadPoolExecutor(4) as pool:
        with httpx.stream("POST", url + "/v1/completions", timeout=60,
                          json={"model": MODEL, "prompt": "a long stream", "max_tokens": 100, "stream": True}) as r:
            assert r.status_code == 200
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                event = json.loads(line[6:])
                assert "error" not in event, event
                pieces.append(event["choices"][0]["text"])
                if len(pieces) == 5:
                    replies = [pool.submit(_complete, url, p, n) for p, n in prompts]  # queued behind the stream
                    group.kill(1)
                    killed.set()
        assert killed.is_set()
        for (prompt, n), reply in zip(prompts, replies):
            assert reply.result().status_code == 200, reply.result().text
            assert reply.result().json()["choices"][0]["text"] == reference_text(model, prompt, n)
    assert "".join(pieces) == reference_text(model, "a long stream", 100)
    stats = _stats()
    assert stats["dead_hosts"] == [1] and stats["retries"] >= 1
    health = httpx.get(url + "/healthz").json()
    assert health["live_hosts"] == [0, 2] and health["dead_hosts"] == [1]


def test_restarted_host_rejoins(cluster, tiny_store, reference_text):
    url, group = cluster
    model, _ = tiny_store
    group.restart(1)
    time.sleep(1.2)  # RemoteExecutor probes a dead host again after probe_after_s = 1 s
    r = _complete(url, "after restart", 4)
    assert r.status_code == 200 and r.json()["choices"][0]["text"] == reference_text(model, "after restart", 4)
    assert _stats()["dead_hosts"] == []


def test_no_live_host_gives_a_clear_503_quickly(cluster):
    url, group = cluster
    for i in range(3):
        group.kill(i)
    start = time.monotonic()
    r = _complete(url, "anyone there?", 4, timeout=30)
    assert r.status_code == 503, r.text
    assert "no expert host can serve" in r.json()["error"]["message"]
    stream = httpx.post(url + "/v1/completions", timeout=30,
                        json={"model": MODEL, "prompt": "x", "max_tokens": 3, "stream": True})
    assert stream.status_code == 503 and "expert host" in stream.json()["error"]["message"]
    assert httpx.get(url + "/healthz").status_code == 503
    assert time.monotonic() - start < 15
    for i in range(3):
        group.restart(i)


def test_corrupt_weight_file_fails_that_replica_clearly_and_the_host_serves_others(tiny_store, tmp_path):
    model, root = tiny_store
    store = tmp_path / "store"
    shutil.copytree(root, store)
    bad = store / "experts" / "l000_e001.safetensors"
    data = bytearray(bad.read_bytes())
    data[len(data) // 2] ^= 0xFF
    bad.write_bytes(bytes(data))
    with launch_local_hosts(1, store, keep_alive_s=60, metrics=False) as group:
        client = ExpertHostClient(group.addresses[0], timeout_s=30)
        executor = RemoteExecutor([client], PlacementSource.static(model.spec.num_layers, model.spec.num_experts, 1))
        engine = Engine(model, executor)
        events = [e for step in engine.run([GenerationRequest(MODEL, 3, False, prompt="hello there")]) for e in step[0]]
        assert events[-1]["error"]["status"] == 500
        assert "l000_e001.safetensors" in events[-1]["error"]["message"]
        x = torch.randn(3, model.spec.hidden_size)
        out = client.invoke(0, {0: x})[0]  # expert 0 of the same layer, same host
        torch.testing.assert_close(out, expert_forward(model.expert_weights(0, 0), x, model.spec.act))
        assert client.health()["ready"]
        executor.close()
        client.close()
