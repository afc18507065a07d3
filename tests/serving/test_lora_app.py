"""Serving LoRA fine-tunes beside their base (BASE+FINETUNE, serving/config.py): loaded with their expert
LoRAs unmerged, their weight stores name the base's experts and carry the factors, their experts are the
base's replicas on the shared hosts, the LoRA applied there at call time. One adapting attention too has an
engine of its own (its attention LoRA is in its non-expert layers); one on experts only joins the base's
engine (serving/family.py). The app answers each model exactly as its in-process model."""

from __future__ import annotations

import re
import urllib.request

import pytest
import torch

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.esft import TrainConfig
from moeless.model.finetune import base_record
from moeless.model.lora import LoraMoEModel, save_lora, train_lora
from moeless.model.tiny import VOCAB, tiny_model
from moeless.model.weight_store import WeightStore
from moeless.serving.config import choose_model
from moeless.serving.embedded import _families, _store

BASE, TUNE, EXPERTS_ONLY = "tiny-moeless-sliced", "tiny-moeless-sliced+lora", "tiny-moeless-sliced+lora-experts"
MODELS = ("tiny:moeless-sliced", "tiny:moeless-sliced+lora", "tiny:moeless-sliced+lora-experts")


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    """A cache holding two LoRA fine-tunes of tiny_model("moeless-sliced", 0): "lora" (attention and experts)
    and "lora-experts" (experts only)."""
    root = tmp_path_factory.mktemp("cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOELESS_CACHE", str(root))
        base = tiny_model("moeless-sliced", 0)
        blocks = torch.randint(0, VOCAB, (6, 16), generator=torch.Generator().manual_seed(1))
        for name, targets in (("lora", "both"), ("lora-experts", "experts")):
            peft_model, _ = train_lora(base, targets, 2, blocks, TrainConfig(steps=3, batch=2, lr=5e-2))
            save_lora(root / "finetunes" / name, peft_model, {"name": name, "base": base_record(base, BASE), "task": "none"})
        yield root


def test_a_lora_fine_tune_gets_its_own_engine_and_a_store_of_factors_over_the_base(cache):
    choices = [choose_model(m) for m in MODELS]
    assert [c.name for c in choices] == [BASE, TUNE, EXPERTS_ONLY]
    assert not choices[1].joins_base and choices[2].joins_base
    # an engine of its own where its attention is not the base's; the base's where only its experts differ
    assert _families(choices) == {BASE: (EXPERTS_ONLY,), TUNE: ()}
    tuned, written = choices[1].loader(), {}
    assert isinstance(tuned, LoraMoEModel) and tuned.expert_loras
    store = WeightStore.open(_store(choices[1], tuned, written))
    assert written[BASE] != store.root and all(store.in_base(l, e) for l, e in store.keys())  # no expert bytes copied
    assert set(store.loras()) == set(tuned.expert_loras)


def test_one_app_serves_a_base_and_its_lora_fine_tunes_each_exactly_on_shared_replicas(cache, ray_serve, reference_text):
    import httpx
    from ray import serve

    from moeless.serving.app import build_app
    from moeless.serving.config import ServeConfig

    choices = [choose_model(m) for m in MODELS]
    family = _families(choices)
    models, written = {c.name: c.loader() for c in choices}, {}
    stores = [(c.name, _store(c, models[c.name], written)) for c in choices]
    with launch_local_hosts(2, stores, keep_alive_s=60) as group:
        configs = [ServeConfig(c.name, c.loader, tuple(group.addresses), replica_cpus=0.1, ingress_cpus=0.1,
                               host_model=c.name, family=family[c.name]) for c in choices if c.name in family]
        assert len(configs) == 2  # the base's engine (with the experts-only LoRA) and the other LoRA's
        serve.run(build_app(configs), name="moeless", route_prefix="/")
        answers = {}
        for name, model in models.items():
            for prompt in ("The cat sat", "A fine day"):
                r = httpx.post(ray_serve + "/v1/completions", json={"model": name, "prompt": prompt, "max_tokens": 6},
                               timeout=120)
                assert r.status_code == 200, r.text
                answers[(name, prompt)] = r.json()["choices"][0]["text"]
                assert answers[(name, prompt)] == reference_text(model, prompt, 6), (name, prompt)
        assert httpx.get(ray_serve + "/metrics", timeout=60).status_code == 200
        spec = models[BASE].spec
        held = []
        for address in group.addresses:
            with ExpertHostClient(address) as host:
                held += [(r["layer"], r["expert"], tuple(r["models"])) for r in host.status()["replicas"] if r["bytes"]]
        assert len(held) <= spec.num_layers * spec.num_experts  # the fine-tune's experts are the base's replicas
        assert any(models_ == (BASE, TUNE, EXPERTS_ONLY) for *_, models_ in held)
        scrape = "\n".join(urllib.request.urlopen(f"{url}/metrics", timeout=10).read().decode()
                           for url in group.metrics_urls)
        shared = [float(v) for v in re.findall(rf'moeless_expert_model_replicas{{kind="shared",model="{re.escape(TUNE)}"}} (\S+)', scrape)]
        lora = [float(v) for v in re.findall(rf'moeless_expert_model_lora_bytes{{model="{re.escape(TUNE)}"}} (\S+)', scrape)]
        assert len(shared) == 2 and sum(shared) > 0 and len(lora) == 2 and all(b > 0 for b in lora), scrape[-2000:]
        serve.delete("moeless")
