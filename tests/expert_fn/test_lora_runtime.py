"""An expert host serving a base and a LoRA fine-tune over it (expert_fn/host/adapters.py): the fine-tune's
calls apply its factors over the base's one replica at call time, exactly as model/experts.expert_forward_lora;
the base's calls on that replica stay plain; the factors are metered as the fine-tune's own memory."""

from __future__ import annotations

import pytest
import torch

from moeless.expert_fn.host.metrics import registry_for
from moeless.expert_fn.host.runtime import ExpertHostRuntime
from moeless.expert_fn.stores.model_stores import ModelStores
from moeless.model.experts import expert_forward, expert_forward_lora
from moeless.model.weight_store import export_experts

L, E, H, F, R = 2, 3, 8, 4, 2


def _weights(g):
    return {"gate": torch.randn(F, H, generator=g), "up": torch.randn(F, H, generator=g), "down": torch.randn(H, F, generator=g)}


@pytest.fixture
def runtime(tmp_path):
    """(runtime over base + lora, base weights, the LoRA factors)."""
    g = torch.Generator().manual_seed(0)
    experts = {(l, e): _weights(g) for l in range(L) for e in range(E)}
    loras = {(1, 2): {"gate_A": torch.randn(R, H, generator=g), "gate_B": torch.randn(F, R, generator=g),
                      "down_A": torch.randn(R, F, generator=g), "down_B": torch.randn(H, R, generator=g)}}
    triples = [(l, e, w) for (l, e), w in experts.items()]
    base = export_experts(triples, tmp_path / "base", model="base", num_layers=L, num_experts=E, act="silu")
    export_experts(triples, tmp_path / "lora", model="lora", num_layers=L, num_experts=E, act="silu", base=base,
                   loras=loras)
    rt = ExpertHostRuntime(ModelStores.open([("base", tmp_path / "base"), ("lora", tmp_path / "lora")]),
                           capacity_bytes=10**8, keep_alive_s=600)
    yield rt, experts, loras
    rt.close()


def test_the_fine_tune_s_calls_apply_its_factors_over_the_shared_replica(runtime):
    rt, experts, loras = runtime
    x = torch.randn(5, H, generator=torch.Generator().manual_seed(1))
    tuned = rt.invoke(L + 1, {2: x, 0: x}).outputs  # the fine-tune's layer 1: expert 2 adapted, expert 0 not
    plain = rt.invoke(1, {2: x}).outputs  # the base's
    want = expert_forward_lora(experts[(1, 2)], loras[(1, 2)], x, "silu")
    assert torch.equal(tuned[2], want) and not torch.equal(tuned[2], plain[2])
    assert torch.equal(plain[2], expert_forward(experts[(1, 2)], x, "silu"))
    assert torch.equal(tuned[0], expert_forward(experts[(1, 0)], x, "silu"))
    out = torch.empty(10, H)  # the routed path: outputs written into one buffer's slices
    rt.invoke(L + 1, {2: x, 0: x}, on_device=True, out=out)
    assert torch.equal(out[:5], want) and torch.equal(out[5:], tuned[0])
    status = rt.status()
    resident = [r for r in status["replicas"] if r["bytes"]]
    assert {(r["layer"], r["expert"]) for r in resident} == {(1, 2), (1, 0)}  # one replica per content key
    assert all(r["models"] == ["base", "lora"] for r in resident)


def test_the_factors_are_the_fine_tune_s_own_memory(runtime):
    rt, _, loras = runtime
    rt.invoke(L + 1, {2: torch.ones(1, H)})
    factor_bytes = sum(t.numel() * 4 for t in loras[(1, 2)].values())
    status = rt.status()
    models, totals = status["models"], status["meters"]
    assert models["lora"]["lora_bytes"] == factor_bytes and models["base"]["lora_bytes"] == 0
    assert models["lora"]["own_replicas"] == 0 and models["lora"]["shared_replicas"] == 1
    assert totals["lora_bytes"] == factor_bytes
    assert sum(m["bytes_held"] for m in models.values()) == totals["bytes_held"]
    assert sum(m["gb_s"] for m in models.values()) == pytest.approx(totals["gb_s"])
    assert models["lora"]["gb_s"] > 0
    scrape = {(s.name, tuple(sorted(s.labels.items()))): s.value for m in registry_for(rt).collect() for s in m.samples}
    assert scrape[("moeless_expert_model_lora_bytes", (("model", "lora"),))] == factor_bytes
    assert scrape[("moeless_expert_model_replicas", (("kind", "shared"), ("model", "lora")))] == 1
