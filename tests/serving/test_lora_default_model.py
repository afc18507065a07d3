"""The default model and its trained LoRA fine-tune code-lora (PEFT, attention and experts: the cache's
finetunes/code-lora, else one trained here for a few steps, which exactness does not depend on) on two expert hosts: the fine-tune's store copies no expert (every one the base's key), the
hosts apply its expert LoRAs over the base's replicas, and each model's logits through the shared hosts
equal its in-process model's (code-lora's: expert LoRAs at call time) bit for bit."""

import pytest
import torch

from moeless.core.paths import cache_dir
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.esft import TrainConfig
from moeless.model.finetune import base_record
from moeless.model.finetune_load import load_finetune
from moeless.model.lora import save_lora, train_lora
from moeless.model.weight_store import export_experts
from moeless.placement.types import Placement
from moeless.serving.executor import RemoteExecutor
from moeless.serving.placement_source import PlacementSource

pytestmark = pytest.mark.slow


def test_the_default_model_and_code_lora_share_every_replica_and_answer_exactly(tmp_path):
    from moeless.model.default import default_model  # builds or loads the default model: slow tests only

    torch.set_num_threads(1)
    base = default_model()
    tune = cache_dir() / "finetunes" / "code-lora"
    if not (tune / "finetune.json").is_file():  # a short LoRA of its own: the same format, fewer steps
        blocks = torch.randint(0, base.spec.vocab_size, (4, 32), generator=torch.Generator().manual_seed(3))
        peft_model, _ = train_lora(base, "both", 4, blocks, TrainConfig(steps=2, batch=2, lr=5e-2))
        tune = save_lora(tmp_path / "code-lora-dir", peft_model,
                         {"name": "code-lora", "base": base_record(base, "default"), "task": {"data": "random"}})
    models = {"base": base, "code-lora": load_finetune(tune, base, merge_expert_lora=False)}
    spec = base.spec
    shape = dict(num_layers=spec.num_layers, num_experts=spec.num_experts, act=spec.act)
    base_store = export_experts(base.iter_experts(), tmp_path / "base", model="base", **shape)
    lora_store = export_experts(models["code-lora"].iter_experts(), tmp_path / "code-lora", model="code-lora",
                                base=base_store, loras=models["code-lora"].expert_loras, **shape)
    assert all(lora_store.in_base(l, e) for l, e in lora_store.keys()) and lora_store.index["loras"]
    ids = torch.tensor([base.tokenizer.encode("def add(a, b):\n    return a + b\n\nprint(add(2, 3))")])
    with launch_local_hosts(2, [("base", base_store.root), ("code-lora", lora_store.root)], metrics=False) as group:
        logits = {}
        for name, model in models.items():
            clients = [ExpertHostClient(a, model=name) for a in group.addresses]
            executor = RemoteExecutor(clients, PlacementSource(Placement.static(spec.num_layers, spec.num_experts, 2)))
            logits[name] = model.forward(ids, executor=executor).logits
            assert torch.equal(logits[name], model.forward(ids).logits), name
            for client in clients:
                client.close()
        assert not torch.equal(logits["base"], logits["code-lora"])
        for address in group.addresses:
            with ExpertHostClient(address) as host:
                status = host.status()
            assert all(r["models"] == ["base", "code-lora"] for r in status["replicas"] if r["bytes"])
            assert status["models"]["code-lora"]["own_replicas"] == 0 and status["models"]["code-lora"]["lora_bytes"] > 0
