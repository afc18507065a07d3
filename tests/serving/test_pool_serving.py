"""The served app follows the expert-host pool: Ray Serve, a ModelServer over a pool file (what
`moeless serve`'s supervisor writes; on Kubernetes the same HostPool follows the policy's pods,
tests/k8s/test_pool_apiserver.py), three real expert-host processes. A host that joins is called
without redeploying; a host that stops being ready gets no new call and /healthz says degraded;
requests running across each change answer exactly what the unmodified model does."""

import json
import time

import httpx
import pytest

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.controller.pool.members import Member
from moeless.controller.pool.sources import FileSource, write_members

MODEL = "tiny-mixtral"


@pytest.fixture(scope="module")
def served(ray_serve, hosts, deploy_tiny, tmp_path_factory):
    path = tmp_path_factory.mktemp("pool") / "pool.json"
    a, b, _ = hosts.addresses
    write_members(path, 3, [Member(0, a), Member(1, b)])  # slot 2 empty at start
    deploy_tiny((), MODEL, pool=FileSource.open(str(path)), pool_period_s=0.1)
    return ray_serve, path


def _invocations(address):
    with ExpertHostClient(address, timeout_s=10) as client:
        return client.status()["meters"]["invocations"]


def _health(url):
    return httpx.get(f"{url}/healthz", timeout=30).json()


def _wait(check, what, timeout_s=20.0):
    deadline = time.monotonic() + timeout_s
    while not check():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.1)


def _complete_during(url, prompt, tokens, change):
    """A streamed completion of `tokens` tokens, `change()` run once its first token is out (the
    request is in flight); its text."""
    chunks = []
    with httpx.stream("POST", f"{url}/v1/completions", timeout=120,
                      json={"model": MODEL, "prompt": prompt, "max_tokens": tokens, "stream": True}) as reply:
        assert reply.status_code == 200
        for line in reply.iter_lines():
            if line.startswith("data: {"):
                chunks.append(json.loads(line[6:])["choices"][0]["text"])
                if len(chunks) == 1:
                    change()
    assert len(chunks) > tokens // 2  # most of the request ran after the change
    return "".join(chunks)


def test_served_app_follows_hosts_joining_and_leaving(served, hosts, tiny_store, reference_text):
    url, path = served
    model, _ = tiny_store
    a, b, c = hosts.addresses
    health = _health(url)
    assert health["status"] == "ok" and health["pool"] == [0, 1] and health["slots"] == 3
    # 1. Host 2 joins while a request decodes: it is called, nothing redeployed, the answer exact.
    text = _complete_during(url, "The cat sat", 30, lambda: write_members(path, 3, [Member(0, a), Member(1, b),
                                                                                     Member(2, c)]))
    assert text == reference_text(model, "The cat sat", 30)
    _wait(lambda: _health(url)["pool"] == [0, 1, 2], "host 2 in the pool")
    before = _invocations(c)
    assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3},
                      timeout=60).status_code == 200
    assert _invocations(c) > before
    # 2. Host 1 stops being ready (draining) while a request decodes: no new call reaches it.
    text = _complete_during(url, "A dog ran", 30, lambda: write_members(path, 3, [Member(0, a), Member(1, b, False),
                                                                                   Member(2, c)]))
    assert text == reference_text(model, "A dog ran", 30)
    health = _health(url)
    assert health["pool"] == [0, 2] and health["not_ready"] == [1] and health["status"] == "degraded"
    seen = _invocations(b)
    assert httpx.post(f"{url}/v1/completions", json={"model": MODEL, "prompt": "Hi", "max_tokens": 3},
                      timeout=60).status_code == 200
    assert _invocations(b) == seen
