"""load_moe_model from local directories, and the weight store round trip, for every arch."""

from __future__ import annotations

import json

import pytest
import torch

from moeless.model.experts import expert_forward
from moeless.model.hf_loader import ModelLoadError, load_moe_model
from moeless.model.moe_model import LocalExecutor
from moeless.model.sliced_moe import save_sliced
from moeless.model.tiny import TINY_ARCHS
from moeless.model.weight_store import WeightStoreError, export_experts

ATOL = 1e-5


def _save(model, path) -> None:
    if model.spec.arch == "moeless-sliced":
        save_sliced(model.hf, path)
    else:
        model.hf.save_pretrained(path)


def _export(model, root):
    spec = model.spec
    return export_experts(model.iter_experts(), root, model=spec.arch, num_layers=spec.num_layers,
                          num_experts=spec.num_experts, act=spec.act)


@pytest.mark.parametrize("arch", TINY_ARCHS)
def test_save_load_export_and_run_from_the_store(tiny, arch, tmp_path):
    original = tiny(arch, seed=1)
    _save(original, tmp_path / "model")
    model = load_moe_model(tmp_path / "model")
    assert model.spec == original.spec
    if arch != "moeless-sliced":
        assert model.hf.config._experts_implementation == "eager"
    ids = torch.randint(0, 128, (1, 8))
    expected = original.forward(ids).logits
    torch.testing.assert_close(model.forward(ids).logits, expected, atol=0, rtol=0)

    # 1. every stored expert computes what the model's own expert computes
    store = _export(model, tmp_path / "store")
    x = torch.randn(4, model.spec.hidden_size)
    for l, e, weights in model.iter_experts():
        ours = expert_forward(store.load(l, e), x, store.act)
        torch.testing.assert_close(ours, expert_forward(weights, x, model.spec.act), atol=0, rtol=0)

    # 2. a model without its experts, run from the store, reproduces the logits
    model.drop_experts()
    from_store = model.forward(ids, executor=LocalExecutor(store.load, store.act)).logits
    torch.testing.assert_close(from_store, expected, atol=ATOL, rtol=0)


def test_store_names_a_corrupt_or_missing_expert_file(tiny, tmp_path):
    store = _export(tiny("olmoe"), tmp_path)
    corrupt = tmp_path / "experts" / "l001_e003.safetensors"
    data = bytearray(corrupt.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte inside tensor data
    corrupt.write_bytes(bytes(data))
    with pytest.raises(WeightStoreError, match="l001_e003.safetensors: checksum mismatch"):
        store.load(1, 3)
    (tmp_path / "experts" / "l000_e005.safetensors").unlink()
    with pytest.raises(WeightStoreError, match="l000_e005.safetensors: expert weight file is missing"):
        store.load(0, 5)
    assert set(store.load(0, 4)) == {"gate", "up", "down"}


@pytest.mark.parametrize("arch", ["mixtral", "moeless-sliced"])
@pytest.mark.parametrize("damage", ["truncate", "header"])
def test_corrupt_model_file_is_named(tiny, tmp_path, arch, damage):
    _save(tiny(arch), tmp_path)
    weights = tmp_path / "model.safetensors"
    data = weights.read_bytes()
    weights.write_bytes(data[:-64] if damage == "truncate" else data[:8] + b"\xff" * 16 + data[24:])
    with pytest.raises(ModelLoadError, match="model.safetensors: corrupt safetensors file"):
        load_moe_model(tmp_path)


def test_missing_or_unsupported_directories_give_clear_errors(tiny, tmp_path):
    with pytest.raises(ModelLoadError, match="no such model directory"):
        load_moe_model(tmp_path / "absent")
    with pytest.raises(ModelLoadError, match="config.json: missing"):
        load_moe_model(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "gpt2"}))
    with pytest.raises(ModelLoadError, match="unsupported model_type 'gpt2'; supported: moeless-sliced, mixtral"):
        load_moe_model(tmp_path)
    _save(tiny("qwen3_moe"), tmp_path)
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelLoadError, match="model.safetensors: weight file is missing"):
        load_moe_model(tmp_path)


def test_sharded_checkpoint_loads_and_a_missing_shard_is_named(tiny, tmp_path):
    original = tiny("mixtral")
    original.hf.save_pretrained(tmp_path, max_shard_size="40KB")
    shards = sorted(tmp_path.glob("model-*.safetensors"))
    assert len(shards) > 1
    ids = torch.randint(0, 128, (1, 5))
    torch.testing.assert_close(load_moe_model(tmp_path).forward(ids).logits, original.forward(ids).logits, atol=0, rtol=0)
    shards[-1].unlink()
    with pytest.raises(ModelLoadError, match=f"{shards[-1].name}: weight file is missing"):
        load_moe_model(tmp_path)


def _legacy_state_dict(model) -> dict[str, torch.Tensor]:
    """The model's weights under the per-expert names of Hub checkpoints (before transformers 5
    fused the experts): Mixtral/Phi-3.5-MoE `block_sparse_moe.experts.<e>.w1|w3|w2` and
    `block_sparse_moe.gate` (phimoe's router), the others `mlp.experts.<e>.gate_proj|up_proj|down_proj`."""
    mixtral_style = model.spec.arch in ("mixtral", "phimoe")
    state = {}
    for key, value in model.hf.state_dict().items():
        if ".experts.gate_up_proj" in key or ".experts.down_proj" in key:
            continue
        if mixtral_style:
            key = key.replace(".mlp.router.", ".mlp.gate.").replace(".mlp.", ".block_sparse_moe.")
        state[key] = value.contiguous()
    names = {"gate": "w1", "up": "w3", "down": "w2"} if mixtral_style else {n: f"{n}_proj" for n in ("gate", "up", "down")}
    block = "block_sparse_moe" if mixtral_style else "mlp"
    for l, e, weights in model.iter_experts():
        prefix = f"model.layers.{model.spec.moe_layer_ids[l]}.{block}.experts.{e}"
        for name, tensor in weights.items():
            state[f"{prefix}.{names[name]}.weight"] = tensor.contiguous()
    return state


@pytest.mark.parametrize("arch", ["mixtral", "phimoe", "qwen2_moe", "deepseek_v3"])
def test_hub_checkpoints_with_per_expert_weights_load(tiny, arch, tmp_path):
    from safetensors.torch import save_file

    original = tiny(arch, seed=2)
    original.hf.config.save_pretrained(tmp_path)
    save_file(_legacy_state_dict(original), str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    model = load_moe_model(tmp_path)
    ids = torch.randint(0, 128, (1, 7))
    torch.testing.assert_close(model.forward(ids).logits, original.forward(ids).logits, atol=0, rtol=0)


def test_model_export_dtype_writes_the_experts_in_it(tiny, tmp_path, capsys):
    from moeless.cli import main
    from moeless.model.weight_store import WeightStore

    original = tiny("mixtral", seed=1)
    _save(original, tmp_path / "model")
    assert main(["model", "export", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "store"),
                 "--dtype", "bfloat16"]) == 0
    assert "bfloat16" in capsys.readouterr().out
    store = WeightStore.open(tmp_path / "store")
    assert store.index["dtype"] == "bfloat16"
    for layer, expert, weights in original.iter_experts():
        loaded = store.load(layer, expert)
        assert all(torch.equal(loaded[n], weights[n].to(torch.bfloat16)) for n in weights)
    with pytest.raises(SystemExit):
        main(["model", "export", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "x"), "--dtype", "int8"])
