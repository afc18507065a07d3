"""LoRA fine-tunes on a tiny model: trained and loaded with peft, expert LoRAs applied at call time
(expert_forward_lora) against peft's own forward, and malformed PEFT folders refused
(model/lora.py, model/experts.py)."""

from __future__ import annotations

import copy
import json
import shutil

import pytest
import torch
from peft import PeftModel
from safetensors.torch import load_file, save_file

from moeless.model.esft import TrainConfig
from moeless.model.experts import expert_forward, expert_forward_lora
from moeless.model.finetune import FinetuneError, base_record
from moeless.model.finetune_load import load_finetune
from moeless.model.lora import ADAPTER_DIR, LoraMoEModel, expert_loras, save_lora, train_lora
from moeless.model.tiny import VOCAB, tiny_model

IDS = torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(7))


def blocks() -> torch.Tensor:
    return torch.randint(0, VOCAB, (6, 16), generator=torch.Generator().manual_seed(1))


@pytest.fixture(scope="module")
def base():
    return tiny_model("moeless-sliced", seed=0)


@pytest.fixture(scope="module", params=["experts", "both", "attention"])
def made(request, base, tmp_path_factory):
    """(targets, the trained PeftModel, its fine-tune directory)."""
    peft_model, stats = train_lora(base, request.param, 2, blocks(), TrainConfig(steps=3, batch=2, lr=5e-2))
    assert stats["steps"] == 3 and stats["parameters"] > 0
    manifest = {"name": f"lora-{request.param}", "base": base_record(base, "tiny"), "task": {"data": "random"}}
    root = save_lora(tmp_path_factory.mktemp(request.param), peft_model, manifest)
    return request.param, peft_model, root


def peft_logits(peft_model) -> torch.Tensor:
    with torch.no_grad():
        return peft_model(input_ids=IDS).logits


def test_training_touches_only_the_adapter(base, made):
    _, peft_model, _ = made
    fresh = tiny_model("moeless-sliced", seed=0)
    for name, tensor in fresh.hf.state_dict().items():
        assert torch.equal(base.hf.state_dict()[name], tensor), f"training modified the base's {name}"
    trained = {n for n, p in peft_model.named_parameters() if p.requires_grad}
    assert trained and all("lora_" in n for n in trained)
    assert any(float(p.detach().abs().sum()) > 0 for n, p in peft_model.named_parameters() if "lora_B" in n)


def test_the_folder_is_peft_format_and_peft_loads_it(base, made):
    _, peft_model, root = made
    assert {"adapter_config.json", "adapter_model.safetensors"} <= {p.name for p in (root / ADAPTER_DIR).iterdir()}  # + peft's README.md
    reloaded = PeftModel.from_pretrained(copy.deepcopy(base.hf), str(root / ADAPTER_DIR))
    assert torch.equal(peft_logits(reloaded), peft_logits(peft_model))


def test_merged_and_call_time_models_match_peft(base, made):
    targets, peft_model, root = made
    expected = peft_logits(peft_model)
    merged = load_finetune(root, base=base)
    assert type(merged).__name__ == "MoEModel"
    assert torch.allclose(merged.forward(IDS).logits, expected, atol=1e-5)
    call_time = load_finetune(root, base=base, merge_expert_lora=False)
    assert isinstance(call_time, LoraMoEModel) == (targets != "attention")
    logits = call_time.forward(IDS).logits
    assert torch.allclose(logits, expected, atol=1e-5)
    assert not torch.allclose(logits, base.forward(IDS).logits, atol=1e-3)  # the adapter does something
    assert torch.equal(call_time.forward(IDS).logits, logits)  # deterministic


def test_call_time_expert_lora_equals_peft_on_the_moe_block(base, made):
    """One MoE block: peft's forward (its LoRA parametrisation of the stacked experts) against the
    routed sum of expert_forward_lora over the base's unchanged expert weights."""
    targets, peft_model, root = made
    loras = expert_loras(root / ADAPTER_DIR, base)
    if targets == "attention":
        assert loras == {}
        return
    assert set(loras) == {(layer, e) for layer in range(2) for e in range(4)}
    assert sorted(loras[(0, 0)]) == ["down_A", "down_B", "gate_A", "gate_B", "up_A", "up_B"]
    x = torch.randn(10, base.spec.hidden_size, generator=torch.Generator().manual_seed(3))
    for layer in range(base.spec.num_layers):
        with torch.no_grad():
            expected = peft_model.base_model.model.model.layers[layer].mlp(x[None])[0]
        routing = base.route(layer, x)
        out = torch.zeros_like(x)
        for t in range(len(x)):
            for e in routing.idx[t].tolist():
                out[t] += expert_forward_lora(base.expert_weights(layer, e), loras[(layer, e)], x[t:t + 1])[0]
        assert torch.allclose(out, expected, atol=1e-5), f"layer {layer}"


def test_expert_forward_lora_is_deterministic_and_exact_without_a_lora(base):
    weights = base.expert_weights(0, 1)
    x = torch.randn(5, base.spec.hidden_size, generator=torch.Generator().manual_seed(0))
    assert torch.equal(expert_forward_lora(weights, {}, x), expert_forward(weights, x))
    g = torch.Generator().manual_seed(1)
    lora = {"up_A": torch.randn(2, 32, generator=g), "up_B": torch.randn(16, 2, generator=g)}
    y = expert_forward_lora(weights, lora, x)
    assert torch.equal(y, expert_forward_lora(weights, lora, x))
    merged = dict(weights, up=weights["up"] + lora["up_B"] @ lora["up_A"])
    assert torch.allclose(y, expert_forward(merged, x), atol=1e-5)


def broken_copy(root, tmp_path):
    """A copy of the fine-tune directory to break, and its adapter folder."""
    target = tmp_path / "broken"
    shutil.copytree(root, target)
    return target, target / ADAPTER_DIR


def test_malformed_adapters_are_refused_naming_the_file(base, made, tmp_path):
    targets, _, root = made
    if targets != "both":
        return
    ft, adapter = broken_copy(root, tmp_path)
    config = json.loads((adapter / "adapter_config.json").read_text())
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "target_modules": ["q_proj", "nope_proj"]}))
    with pytest.raises(FinetuneError, match=r"adapter_config\.json: target module 'nope_proj' is not a Linear module"):
        load_finetune(ft, base=base)
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "target_parameters": ["mlp.router.weight"]}))
    with pytest.raises(FinetuneError, match=r"adapter_config\.json: target parameter 'mlp.router.weight' is not an expert"):
        load_finetune(ft, base=base)
    (adapter / "adapter_config.json").write_text(json.dumps({**config, "peft_type": "PREFIX_TUNING"}))
    with pytest.raises(FinetuneError, match=r"adapter_config\.json: not a PEFT LoRA config"):
        load_finetune(ft, base=base)
    (adapter / "adapter_config.json").write_text(json.dumps(config))
    tensors = load_file(str(adapter / "adapter_model.safetensors"))
    key = "base_model.model.model.layers.1.mlp.base_layer.lora_A.weight"  # up_proj's A: [r E, H] = [8, 32]
    save_file({**tensors, key: torch.zeros(8, 31)}, str(adapter / "adapter_model.safetensors"))
    with pytest.raises(FinetuneError, match=r"adapter_model\.safetensors: .*layers\.1\.mlp\.base_layer\.lora_A\.weight "
                                            r"is \[8, 31\] but the base needs \[8, 32\]$"):
        load_finetune(ft, base=base)
    (adapter / "adapter_model.safetensors").write_bytes(b"not safetensors")
    with pytest.raises(FinetuneError, match=r"adapter_model\.safetensors: not a readable safetensors file"):
        load_finetune(ft, base=base)
    (adapter / "adapter_config.json").unlink()
    with pytest.raises(FinetuneError, match=r"adapter_config\.json: missing"):
        load_finetune(ft, base=base)


def test_expert_lora_needs_the_sliced_arch():
    with pytest.raises(ValueError, match="moeless-sliced"):
        train_lora(tiny_model("mixtral"), "experts", 2, blocks(), TrainConfig(steps=1))
