"""The real default model (SmolLM2-135M MoEfied) end to end over HTTP with two expert hosts."""

import httpx
import numpy as np
import pytest
import torch

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.placement.types import LayerPlacement, Placement
from moeless.serving.api import ChatMessage, GenerationRequest
from moeless.model.weight_store import export_store
from moeless.serving.engine import Engine
from moeless.serving.executor import RemoteExecutor
from moeless.serving.placement_source import PlacementSource

pytestmark = pytest.mark.slow
NAME = "moeless-default"
QUESTION = "What is the capital of France?"


@pytest.fixture(scope="module")
def default_setup(ray_serve):
    from ray import serve

    from moeless.model.default import default_model
    from moeless.serving.app import build_app
    from moeless.serving.config import ServeConfig

    torch.set_num_threads(1)
    model = default_model()
    with launch_local_hosts(2, export_store(model, NAME), metrics=False) as group:
        serve.run(build_app(ServeConfig(NAME, default_model, tuple(group.addresses), replica_cpus=0.25,
                                        ingress_cpus=0.1)), name="moeless", route_prefix="/")
        yield model, group, ray_serve


def _reference_answer(model, max_tokens):
    request = GenerationRequest(NAME, max_tokens, False, messages=(ChatMessage("user", QUESTION),))
    events = [e for step in Engine(model).run([request]) for e in step[0]]
    return "".join(e.get("text", "") for e in events)


def _split(spec):
    """Every expert with a replica on each host, shares 0.3 / 0.7: each expert's tokens cross hosts."""
    expert = np.repeat(np.arange(spec.num_experts), 2)
    layer = LayerPlacement(expert, np.tile([0, 1], spec.num_experts), np.tile([0.3, 0.7], spec.num_experts))
    return Placement((layer,) * spec.num_layers, spec.num_experts, 2)


@pytest.mark.parametrize("split", [False, True], ids=["static", "split"])
def test_default_model_logits_through_expert_hosts_equal_reference(default_setup, split):
    model, group, _ = default_setup
    spec = model.spec
    clients = [ExpertHostClient(a) for a in group.addresses]
    placement = _split(spec) if split else Placement.static(spec.num_layers, spec.num_experts, 2)
    executor = RemoteExecutor(clients, PlacementSource(placement))
    ids = torch.tensor([model.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 3)])
    ref = model.forward(ids).logits
    got = model.forward(ids, executor=executor).logits
    if not split:  # each expert's tokens in one batch, as in-process: the same bits
        assert torch.equal(got, ref)
    else:
        # Split tokens are computed in other batch sizes; for this model's 48-neuron experts MKL
        # rounds some row counts differently (chunks of >= scatter.MIN_CHUNK rows do not avoid it,
        # measured), so the split path equals the reference up to float rounding only.
        torch.testing.assert_close(got, ref, rtol=0, atol=1e-4)
        assert torch.equal(model.generate(ids, 8, executor=executor), model.generate(ids, 8))
    executor.close()


def test_default_model_chat_over_http_equals_reference(default_setup):
    model, _, url = default_setup
    doc = {"model": NAME, "messages": [{"role": "user", "content": QUESTION}], "max_tokens": 12}
    r = httpx.post(url + "/v1/chat/completions", json=doc, timeout=300)
    assert r.status_code == 200, r.text
    answer = r.json()["choices"][0]["message"]["content"]
    assert answer == _reference_answer(model, 12) and answer.strip()
