"""The default model and three ESFT-shaped fine-tunes of it (12.5% of each layer's experts changed:
the bench's stand-ins) on two expert hosts: every expert of the four held in 1.375x the base's
memory (whole models: 4x), each model's logits through the shared hosts equal to its merged model's."""

import pytest
import torch

from moeless.bench.finetunes import stand_in_finetune
from moeless.expert_fn.client.client import ExpertHostClient
from moeless.expert_fn.launcher import launch_local_hosts
from moeless.model.finetune_load import load_finetune
from moeless.model.weight_store import export_store
from moeless.placement.types import Placement
from moeless.serving.executor import RemoteExecutor
from moeless.serving.placement_source import PlacementSource

pytestmark = pytest.mark.slow


def test_a_base_and_three_fine_tunes_hold_each_shared_expert_once_and_answer_exactly(tmp_path, monkeypatch):
    from moeless.bench.finetunes_report import memory_held, prewarm
    from moeless.model.default import default_model

    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))  # the stand-ins and stores; the model itself from the cache
    torch.set_num_threads(1)
    base = default_model()
    spec = base.spec
    models = {"base": base} | {f"ft{i}": load_finetune(stand_in_finetune(base, "moeless-default", i, 0.125, 0), base)
                                for i in range(3)}
    base_store = export_store(base, "base")
    stores = [("base", base_store)] + [(n, export_store(m, n, base=base_store)) for n, m in list(models.items())[1:]]
    with launch_local_hosts(2, stores, metrics=False) as group:
        prewarm(group.addresses, [(name, spec) for name in models])
        held = memory_held(group.addresses)
        one = 3 * spec.expert_ffn * spec.hidden_size * 4
        assert held["bytes_held"] == (spec.num_layers * spec.num_experts) * one * (1 + 3 * 0.125)
        assert held["parts_add_up"]
        ids = torch.tensor([base.tokenizer.encode("The quick brown fox jumps over the lazy dog. " * 2)])
        for name, model in models.items():
            clients = [ExpertHostClient(a, model=name) for a in group.addresses]
            executor = RemoteExecutor(clients, PlacementSource(Placement.static(spec.num_layers, spec.num_experts, 2)))
            assert torch.equal(model.forward(ids, executor=executor).logits, model.forward(ids).logits), name
            for client in clients:
                client.close()
