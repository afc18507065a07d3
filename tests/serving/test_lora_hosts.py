"""A base and a LoRA fine-tune (attention and experts adapted, PEFT format) on the same expert-host
processes: the fine-tune's store names every expert by the base's key, so each expert is one shared
replica, and the hosts apply the fine-tune's expert LoRA over it at call time (expert_fn/host/adapters.py).
Both models calling at once, each equals its in-process model bit for bit (the fine-tune's: load_finetune
with merge_expert_lora=False), logits and greedy tokens."""

from __future__ import annotations

import threading

import pytest
import torch

from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.esft import TrainConfig
from moeless.model.finetune import base_record
from moeless.model.finetune_load import load_finetune
from moeless.model.lora import save_lora, train_lora
from moeless.model.moe_model import MoEModel
from moeless.model.tiny import VOCAB, tiny_model
from moeless.model.weight_store import export_experts
from moeless.placement.types import Placement
from moeless.serving.executor import RemoteExecutor
from moeless.serving.placement_source import PlacementSource

TUNE = "tiny+lora"


@pytest.fixture(scope="module")
def lora_family(tmp_path_factory):
    """({name: in-process model}, [(name, store)]): a tiny base and a LoRA fine-tune ("both"), its store over the base's."""
    base = tiny_model("moeless-sliced", seed=0)
    blocks = torch.randint(0, VOCAB, (6, 16), generator=torch.Generator().manual_seed(1))
    peft_model, _ = train_lora(base, "both", 2, blocks, TrainConfig(steps=3, batch=2, lr=5e-2))
    root = save_lora(tmp_path_factory.mktemp("tune"), peft_model,
                     {"name": "lora", "base": base_record(base, "tiny"), "task": {"data": "random"}})
    tuned = load_finetune(root, base=base, merge_expert_lora=False)  # the reference: expert LoRAs at call time
    spec, out = base.spec, tmp_path_factory.mktemp("stores")
    shape = dict(num_layers=spec.num_layers, num_experts=spec.num_experts, act=spec.act)
    base_store = export_experts(base.iter_experts(), out / "base", model="tiny", **shape)
    export_experts(tuned.iter_experts(), out / "lora", model=TUNE, base=base_store, loras=tuned.expert_loras, **shape)
    return {"tiny": base, TUNE: tuned}, [("tiny", out / "base"), (TUNE, out / "lora")]


def _executor(addresses, name: str, model: MoEModel) -> RemoteExecutor:
    clients = [ExpertHostClient(a, timeout_s=30, model=name) for a in addresses]
    spec = model.spec
    return RemoteExecutor(clients, PlacementSource(Placement.static(spec.num_layers, spec.num_experts, len(clients))))


def _run_both(models, executors, count: int = 3) -> dict[str, list[str]]:
    """Every model's forwards and greedy decodes through the hosts, both models at once -> mismatches."""
    wrong: dict[str, list[str]] = {name: [] for name in models}
    g = torch.Generator().manual_seed(5)
    batches = [torch.randint(0, VOCAB, (2, 8), generator=g) for _ in range(count)]

    def run(name: str) -> None:
        model = models[name]
        for i, ids in enumerate(batches):
            mask = torch.ones_like(ids)
            try:
                if not torch.equal(model.forward(ids, mask, executor=executors[name]).logits, model.forward(ids, mask).logits):
                    wrong[name].append(f"batch {i}: logits differ")
                if not torch.equal(model.generate(ids, 4, executor=executors[name]), model.generate(ids, 4)):
                    wrong[name].append(f"batch {i}: tokens differ")
            except Exception as err:  # recorded: the test names the model and the batch
                wrong[name].append(f"batch {i}: {type(err).__name__}: {err}")

    threads = [threading.Thread(target=run, args=(name,)) for name in models]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return wrong


def test_a_base_and_its_lora_fine_tune_on_shared_hosts_each_equal_their_in_process_model(lora_family):
    models, stores = lora_family
    ids = torch.randint(0, VOCAB, (2, 8), generator=torch.Generator().manual_seed(9))
    assert not torch.equal(models[TUNE].forward(ids).logits, models["tiny"].forward(ids).logits)  # the LoRA matters
    spec = models["tiny"].spec
    with launch_local_hosts(2, stores, keep_alive_s=60, metrics=False) as group:
        executors = {name: _executor(group.addresses, name, model) for name, model in models.items()}
        assert _run_both(models, executors) == {name: [] for name in models}
        factors = sum(t.numel() * 4 for lora in models[TUNE].expert_loras.values() for t in lora.values())
        held = []
        for address in group.addresses:
            with ExpertHostClient(address) as host:
                status = host.status()
            resident = [r for r in status["replicas"] if r["bytes"]]
            held += [(r["layer"], r["expert"]) for r in resident]
            assert all(r["layer"] < spec.num_layers and r["models"] == ["tiny", TUNE] for r in resident)
            parts = status["models"]
            assert parts[TUNE]["own_replicas"] == 0 and parts[TUNE]["shared_replicas"] == len(resident)
            assert parts[TUNE]["lora_bytes"] == factors and parts[TUNE]["tokens"] > 0  # every host holds its factors
        assert len(held) == len(set(held)) <= spec.num_layers * spec.num_experts  # each expert held once, the base's
        for executor in executors.values():
            for client in executor.pool.clients().values():
                client.close()
