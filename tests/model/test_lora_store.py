"""A LoRA fine-tune's weight store over its base's (model/lora_store.py, model/weight_store.py): every
expert named by the base's content key (no expert bytes copied), its expert LoRA factors stored per
expert and read back bit for bit; a corrupt or missing factor file refused in one line naming the
model and the expert, at open by an expert host's stores too."""

from __future__ import annotations

import pytest
import torch

from moeless.expert_fn.stores.model_stores import ModelStores
from moeless.model.esft import TrainConfig
from moeless.model.finetune import base_record
from moeless.model.finetune_load import load_finetune
from moeless.model.lora import LoraMoEModel, save_lora, train_lora
from moeless.model.tiny import VOCAB, tiny_model
from moeless.model.weight_store import WeightStore, WeightStoreError, export_experts, export_store


@pytest.fixture(scope="module")
def stores(tmp_path_factory):
    """(base, the call-time LoRA model, the base's store, the LoRA fine-tune's store over it)."""
    base = tiny_model("moeless-sliced", seed=0)
    blocks = torch.randint(0, VOCAB, (6, 16), generator=torch.Generator().manual_seed(1))
    peft_model, _ = train_lora(base, "both", 2, blocks, TrainConfig(steps=2, batch=2, lr=5e-2))
    manifest = {"name": "lora-both", "base": base_record(base, "tiny"), "task": {"data": "random"}}
    root = save_lora(tmp_path_factory.mktemp("tune"), peft_model, manifest)
    tuned = load_finetune(root, base=base, merge_expert_lora=False)
    assert isinstance(tuned, LoraMoEModel) and tuned.expert_loras
    spec, out = base.spec, tmp_path_factory.mktemp("stores")
    shape = dict(num_layers=spec.num_layers, num_experts=spec.num_experts, act=spec.act)
    base_store = export_experts(base.iter_experts(), out / "base", model="tiny", **shape)
    lora_store = export_experts(tuned.iter_experts(), out / "lora", model="tiny+lora-both", base=base_store,
                                loras=tuned.expert_loras, **shape)
    return base, tuned, base_store, lora_store


def test_every_expert_is_the_base_s_and_the_factors_round_trip(stores):
    base, tuned, base_store, lora_store = stores
    opened = WeightStore.open(lora_store.root)
    assert all(opened.in_base(l, e) and opened.key(l, e) == base_store.key(l, e) for l, e in opened.keys())
    assert not (lora_store.root / "experts").exists() or not any((lora_store.root / "experts").iterdir())
    loras = opened.loras()
    assert set(loras) == set(tuned.expert_loras) == set(opened.keys())  # "both": every expert adapted
    for key, lora in tuned.expert_loras.items():
        assert set(loras[key]) == set(lora) == {"gate_A", "gate_B", "up_A", "up_B", "down_A", "down_B"}
        assert all(torch.equal(loras[key][n], t) for n, t in lora.items()), key
    assert len(list((lora_store.root / "loras").iterdir())) == len(loras)
    assert WeightStore.open(base_store.root).loras() == {}


def test_export_store_writes_a_lora_model_s_factors_over_the_base(stores, tmp_path, monkeypatch):
    base, tuned, _, _ = stores
    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path))
    base_root = export_store(base, "tiny")
    root = export_store(tuned, "tiny+lora-both", base=base_root)
    store = WeightStore.open(root)
    assert all(store.in_base(l, e) for l, e in store.keys())
    assert set(store.loras()) == set(tuned.expert_loras)
    assert export_store(tuned, "tiny+lora-both", base=base_root) == root  # cached: the same factors, the same store


@pytest.mark.parametrize("damage", ["corrupt", "missing"])
def test_a_damaged_factor_file_is_refused_naming_the_model_and_the_expert(stores, tmp_path, damage):
    base, tuned, base_store, _ = stores
    spec = base.spec
    copy = export_experts(tuned.iter_experts(), tmp_path / "lora", model="tiny+lora-both", base=base_store,
                          loras=tuned.expert_loras, num_layers=spec.num_layers, num_experts=spec.num_experts,
                          act=spec.act).root  # a store of its own to damage
    index = WeightStore.open(copy).index
    victim = copy / index["loras"]["1/2"]["file"]
    if damage == "missing":
        victim.unlink()
    else:
        data = bytearray(victim.read_bytes())
        data[-1] ^= 0xFF
        victim.write_bytes(bytes(data))
    want = rf"model tiny\+lora-both: expert \(1, 2\): .*l001_e002.*: (LoRA factor file is missing|checksum mismatch)"
    with pytest.raises(WeightStoreError, match=want) as err:
        WeightStore.open(copy).loras()
    assert "\n" not in str(err.value)  # one line
    with pytest.raises(WeightStoreError, match=want):  # an expert host refuses to serve it
        ModelStores.open([("tiny", base_store.root), ("tiny+lora-both", copy)])
