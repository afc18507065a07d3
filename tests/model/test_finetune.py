"""ESFT fine-tunes on tiny models: expert scores and selection, training only the selected experts,
the artefact's round trip and its refusals (model/esft.py, model/finetune.py)."""

from __future__ import annotations

import json

import pytest
import torch

from moeless.model.esft import TrainConfig, expert_scores, select_experts, train_experts
from moeless.model.finetune import (
    MANIFEST,
    FinetuneError,
    base_record,
    replaced_experts,
    save_esft,
    weights_fingerprint,
)
from moeless.model.finetune_load import load_finetune
from moeless.model.moe_model import MoEModel
from moeless.model.tiny import VOCAB, _tiny_sliced, tiny_model

# Router rows of the golden model: every token's gate input has a large positive coordinate 0 and
# the router reads only that one, so each layer ranks its 4 experts the same way for every token.
GOLDEN_ROUTER = [[0.0, 3.0, 1.0, 2.0], [2.0, 0.0, 1.0, -1.0]]  # top-2: {1, 3} in layer 0, {0, 2} in layer 1
SELECTED = [[1, 3], [0, 2]]


def golden_model() -> MoEModel:
    model = tiny_model("moeless-sliced", seed=0)
    with torch.no_grad():
        model.hf.model.embed_tokens.weight[:, 0] = 50.0
        for layer, row in enumerate(GOLDEN_ROUTER):
            model.gate(layer).weight.zero_()
            model.gate(layer).weight[:, 0] = torch.tensor(row)
    return model


def token_blocks(rows: int = 8, length: int = 16, seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (rows, length), generator=torch.Generator().manual_seed(seed))


@pytest.fixture(scope="module")
def tuned():
    """(base, fine-tuned model, stats) of an ESFT of the golden model's selected experts."""
    base = golden_model()
    model, stats = train_experts(base, SELECTED, token_blocks(), TrainConfig(steps=3, batch=2, lr=1e-2))
    return base, model, stats


def save(tmp_path, base: MoEModel, model: MoEModel, replaced, name: str = "t"):
    manifest = {"name": name, "base": base_record(base, "golden-tiny"), "task": {"data": "random"}}
    return save_esft(tmp_path / name, model, replaced, manifest)


def test_selection_golden_example():
    s = torch.tensor([[0.10, 0.40, 0.30, 0.20], [0.25, 0.25, 0.05, 0.45]])
    assert select_experts(s, 0.5) == [[1, 2], [0, 3]]  # the tie of experts 0 and 1 goes to 0
    assert select_experts(s, 0.5, threshold=0.4) == [[1], [3]]  # ESFT's cumulative rule stops early
    assert select_experts(s, 0.5, threshold=0.9) == [[1, 2], [0, 3]]  # ... and the share caps it
    assert select_experts(s, 1.0, threshold=0.85) == [[1, 2, 3], [0, 1, 3]]
    with pytest.raises(ValueError, match="at least one of 4 experts"):
        select_experts(s, 0.2)


def test_scores_and_selection_on_a_tiny_model():
    model, ids = golden_model(), token_blocks()
    token = expert_scores(model, ids, "token")
    assert token.tolist() == [[0.0, 0.5, 0.0, 0.5], [0.5, 0.0, 0.5, 0.0]]
    gate = expert_scores(model, ids, "gate")
    assert (gate[0, 1] > gate[0, 3] > 0) and gate[0, 0] == gate[0, 2] == 0  # expert 1's logit is larger
    assert (gate[1, 0] > gate[1, 2] > 0) and gate[1, 1] == gate[1, 3] == 0
    assert select_experts(token, 0.5) == SELECTED == select_experts(gate, 0.5)
    assert select_experts(gate, 0.25) == [[1], [0]]  # the gate score breaks the token ratio's ties


def test_scores_follow_the_hf_models_own_routing():
    """The token ratio by a second route: hooks on the transformers model's routers, its top-k."""
    model, ids = tiny_model("moeless-sliced", seed=3), token_blocks(seed=3)
    counts = torch.zeros(model.spec.num_layers, model.spec.num_experts, dtype=torch.float64)

    def count(layer: int, logits: torch.Tensor) -> None:  # a hook that returns nothing keeps the output
        counts[layer] += torch.bincount(torch.topk(logits, model.spec.top_k, dim=-1).indices.reshape(-1), minlength=4)

    for layer in range(model.spec.num_layers):
        router = model.hf.model.layers[model.spec.moe_layer_ids[layer]].mlp.router
        router.register_forward_hook(lambda mod, args, out, layer=layer: count(layer, out))
    with torch.no_grad():
        model.hf(ids)
    expected = counts / (ids.numel() * model.spec.top_k)
    assert torch.allclose(expert_scores(model, ids, "token"), expected)


def test_only_the_selected_experts_change(tuned):
    base, model, stats = tuned
    assert stats["steps"] == 3 and stats["tokens"] == 3 * 2 * 16
    fresh = golden_model()
    for name, tensor in base.hf.state_dict().items():
        assert torch.equal(tensor, fresh.hf.state_dict()[name]), f"training modified the base's {name}"
    after = model.hf.state_dict()
    for name, tensor in base.hf.state_dict().items():
        if not name.endswith(("gate_proj", "up_proj", "down_proj")) or "self_attn" in name:
            assert torch.equal(after[name], tensor), name
            continue
        layer = int(name.split(".")[2])
        for e in range(4):
            same = torch.equal(after[name][e], tensor[e])
            assert same == (e not in SELECTED[layer]), f"{name} expert {e}"


def test_training_lowers_the_loss_on_its_data():
    base, ids = golden_model(), token_blocks(rows=2)
    model, _ = train_experts(base, SELECTED, ids, TrainConfig(steps=20, batch=2, lr=1e-2))
    with torch.no_grad():
        assert model.hf(ids, labels=ids).loss < base.hf(ids, labels=ids).loss - 0.1


def test_training_is_deterministic(tuned):
    base, model, _ = tuned
    again, _ = train_experts(base, SELECTED, token_blocks(), TrainConfig(steps=3, batch=2, lr=1e-2))
    assert weights_fingerprint(again) == weights_fingerprint(model)


def test_artefact_round_trip_is_bit_exact(tuned, tmp_path):
    base, model, _ = tuned
    replaced = [(layer, e) for layer, experts in enumerate(SELECTED) for e in experts]
    root = save(tmp_path, base, model, replaced)
    manifest = json.loads((root / MANIFEST).read_text())
    assert manifest["format"] == "moeless-finetune/1" and manifest["method"] == "esft"
    assert [(x["layer"], x["expert"]) for x in manifest["experts"]] == replaced
    assert sorted(p.name for p in (root / "experts").iterdir()) == [
        "l000_e001.safetensors", "l000_e003.safetensors", "l001_e000.safetensors", "l001_e002.safetensors"]
    loaded = load_finetune(root, base=base)
    for name, tensor in model.hf.state_dict().items():
        assert torch.equal(loaded.hf.state_dict()[name], tensor), name
    assert weights_fingerprint(loaded) == weights_fingerprint(model) != weights_fingerprint(base)
    ids = token_blocks(rows=2, seed=5)
    assert torch.equal(loaded.forward(ids).logits, model.forward(ids).logits)
    assert set(replaced_experts(root)) == set(replaced)
    assert weights_fingerprint(base) == weights_fingerprint(golden_model())  # loading leaves the base alone


def test_base_found_by_name_in_the_cache(tuned, tmp_path, monkeypatch):
    base, model, _ = tuned
    root = save(tmp_path, base, model, [(0, 1)])
    monkeypatch.setenv("MOELESS_CACHE", str(tmp_path / "cache"))
    with pytest.raises(FinetuneError, match=r"^fine-tune t needs base golden-tiny \(fingerprint [0-9a-f]{16}\), "
                                            r"found no model at .*cache/golden-tiny$"):
        load_finetune(root)


def test_another_base_is_refused(tuned, tmp_path):
    base, model, _ = tuned
    root = save(tmp_path, base, model, [(0, 1)])
    with pytest.raises(FinetuneError, match=r"^fine-tune t needs base golden-tiny \(fingerprint [0-9a-f]{16}\), "
                                            r"found a moeless-sliced model of 2 x 4 experts \(fingerprint [0-9a-f]{16}\)$"):
        load_finetune(root, base=tiny_model("moeless-sliced", seed=1))


def test_other_expert_shapes_are_refused(tuned, tmp_path):
    base, model, _ = tuned
    root = save(tmp_path, base, model, [(1, 0), (1, 1)])
    other = MoEModel(_tiny_sliced(0, num_experts=2))  # F = 32 instead of 16
    with pytest.raises(FinetuneError, match=r"^fine-tune t: expert \(1, 0\) is \[16, 32\] but base .*'s is \[32, 32\]$"):
        load_finetune(root, base=other)
    root = save(tmp_path, base, model, [(0, 3)], name="u")
    with pytest.raises(FinetuneError, match=r"^fine-tune u: expert \(0, 3\) is not in base .* \(2 layers x 2 experts\)$"):
        load_finetune(root, base=other)


def test_corrupt_and_missing_expert_files_are_named(tuned, tmp_path):
    base, model, _ = tuned
    root = save(tmp_path, base, model, [(0, 1), (1, 0)])
    path = root / "experts" / "l000_e001.safetensors"
    data = bytearray(path.read_bytes())
    data[-1] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(FinetuneError, match=r"^fine-tune t: .*l000_e001\.safetensors: checksum mismatch, the file is corrupt$"):
        load_finetune(root, base=base)
    path.unlink()
    with pytest.raises(FinetuneError, match=r"^fine-tune t: .*l000_e001\.safetensors: expert weight file is missing$"):
        load_finetune(root, base=base)


def test_malformed_manifests_are_refused(tmp_path):
    with pytest.raises(FinetuneError, match=r"finetune\.json: missing"):
        load_finetune(tmp_path)
    (tmp_path / MANIFEST).write_text("{not json")
    with pytest.raises(FinetuneError, match=r"finetune\.json: not valid JSON"):
        load_finetune(tmp_path)
    (tmp_path / MANIFEST).write_text(json.dumps({"format": "moeless-finetune/0"}))
    with pytest.raises(FinetuneError, match=r"finetune\.json: format 'moeless-finetune/0', expected 'moeless-finetune/1'"):
        load_finetune(tmp_path)


def test_esft_needs_the_sliced_arch():
    with pytest.raises(ValueError, match="moeless-sliced"):
        train_experts(tiny_model("mixtral"), [[0], [1]], token_blocks(), TrainConfig(steps=1))
