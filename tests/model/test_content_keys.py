"""Experts addressed by content (model/content_keys.py, model/weight_store.py): every expert's key
is its dtype, shape and file sha256; a store over a base writes only the experts it changed and
names the base's files for the rest; a missing base, another shape, a changed base and a corrupt
file are each refused in one line naming the model and the expert (or the file)."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from moeless.model.content_keys import content_key, key_shape, make_key, parse_key
from moeless.model.finetune import perturbed
from moeless.model.moe_model import MoEModel
from moeless.model.tiny import tiny_model
from moeless.model.weight_store import WeightStore, WeightStoreError, export_experts

CHANGED = [(0, 1), (1, 3)]



def _export(model: MoEModel, root, name: str, base: WeightStore | None = None, experts=None) -> WeightStore:
    spec = model.spec
    return export_experts(experts if experts is not None else model.iter_experts(), root, model=name,
                          num_layers=spec.num_layers, num_experts=spec.num_experts, act=spec.act, base=base)


@pytest.fixture(scope="module")
def base_and_tuned(tmp_path_factory):
    base = tiny_model("mixtral", 0)
    stores = tmp_path_factory.mktemp("stores")
    base_store = _export(base, stores / "base", "base")
    tuned = perturbed(base, CHANGED, 0.01, 1)
    return base, tuned, base_store, _export(tuned, stores / "tuned", "tuned", base=base_store)


def test_every_expert_has_a_key_of_its_dtype_shape_and_file_bytes(base_and_tuned):
    base, _, store, _ = base_and_tuned
    spec = base.spec
    for layer, expert in store.keys():
        entry = store.index["experts"][f"{layer}/{expert}"]
        key = store.key(layer, expert)
        assert key == entry["key"] == content_key((store.root / entry["file"]).read_bytes())
        assert key.endswith(entry["sha256"]) and key_shape(key) == f"float32 {spec.expert_ffn}x{spec.hidden_size}"
    assert len({store.key(l, e) for l, e in store.keys()}) == spec.num_layers * spec.num_experts  # all differ


def test_a_key_parses_back_to_its_dtype_and_shape_and_a_malformed_one_is_named():
    key = make_key("bfloat16", 48, 576, "9f2c" * 16)
    assert parse_key(key) == ("bfloat16", 48, 576) and key_shape(key) == "bfloat16 48x576"
    for bad in ("float32-48x576", "float32-48by576-9f2c", "float32-48x576-", "9f2c"):
        with pytest.raises(ValueError, match="not an expert's content key"):
            parse_key(bad)


def test_a_store_written_before_keys_existed_opens_with_the_same_keys(base_and_tuned, tmp_path):
    _, _, store, _ = base_and_tuned
    old = tmp_path / "old"
    shutil.copytree(store.root, old)
    index = json.loads((old / "index.json").read_text())
    for entry in index["experts"].values():
        del entry["key"]
    (old / "index.json").write_text(json.dumps(index))
    reopened = WeightStore.open(old)
    assert [reopened.key(l, e) for l, e in reopened.keys()] == [store.key(l, e) for l, e in store.keys()]


def test_a_store_over_its_base_writes_only_the_experts_it_changed(base_and_tuned):
    base, tuned, base_store, store = base_and_tuned
    written = sorted(p.name for p in (store.root / "experts").iterdir())
    assert written == [f"l{l:03d}_e{e:03d}.safetensors" for l, e in CHANGED]
    assert store.index["base"] == {"model": "base", "store": "../base"}
    for layer, expert in store.keys():
        same = (layer, expert) not in CHANGED
        assert store.in_base(layer, expert) == same
        assert (store.key(layer, expert) == base_store.key(layer, expert)) == same
        for name, t in store.load(layer, expert).items():  # the base's file or its own, verified either way
            assert torch.equal(t, tuned.expert_weights(layer, expert)[name])
    # a folder of stores moves as one: the base is found relative to the store
    moved = base_store.root.parent.parent / "moved"
    shutil.copytree(base_store.root.parent, moved)
    assert WeightStore.open(moved / "tuned").key(*CHANGED[0]) == store.key(*CHANGED[0])


def test_a_missing_base_is_refused_in_one_line_naming_the_model_and_an_expert(base_and_tuned, tmp_path):
    _, _, _, store = base_and_tuned
    alone = tmp_path / "tuned"
    shutil.copytree(store.root, alone)
    with pytest.raises(WeightStoreError) as err:
        WeightStore.open(alone)
    message = str(err.value)
    assert "\n" not in message and message.startswith("model tuned: expert (0, 0) is base base's, whose store")
    assert "export the base there first" in message


def test_an_expert_whose_shape_differs_from_its_base_s_is_refused(base_and_tuned, tmp_path):
    base, _, base_store, _ = base_and_tuned
    spec = base.spec
    wider = [(l, e, {n: (torch.zeros(spec.expert_ffn * 2, spec.hidden_size) if n != "down" else
                         torch.zeros(spec.hidden_size, spec.expert_ffn * 2)) if (l, e) == (1, 2) else t
                     for n, t in w.items()}) for l, e, w in base.iter_experts()]
    with pytest.raises(WeightStoreError) as err:
        _export(base, tmp_path / "wide", "wide", base=base_store, experts=wider)
    assert str(err.value) == (f"model wide: expert (1, 2) is float32 {2 * spec.expert_ffn}x{spec.hidden_size}, its base "
                              f"base's is float32 {spec.expert_ffn}x{spec.hidden_size}")
    # the same store written without the check, then opened: refused the same way
    _export(base, tmp_path / "wide2", "wide", experts=wider)
    index = json.loads((tmp_path / "wide2" / "index.json").read_text())
    index["base"] = {"model": "base", "store": str(base_store.root)}
    (tmp_path / "wide2" / "index.json").write_text(json.dumps(index))
    with pytest.raises(WeightStoreError, match=r"^model wide: expert \(1, 2\) is float32 .* its base base's is"):
        WeightStore.open(tmp_path / "wide2")


def test_a_base_rewritten_under_a_fine_tune_is_refused(base_and_tuned, tmp_path):
    base, tuned, _, _ = base_and_tuned
    base_store = _export(base, tmp_path / "base", "base")
    _export(tuned, tmp_path / "tuned", "tuned", base=base_store)
    _export(perturbed(base, [(0, 0)], 0.01, 7), tmp_path / "base", "base")  # the base re-exported, other bytes
    with pytest.raises(WeightStoreError, match=r"^model tuned: expert \(0, 0\) is base base's file "
                                               r"\.\./base/experts/l000_e000\.safetensors, which is not the bytes"):
        WeightStore.open(tmp_path / "tuned")


def test_a_corrupt_shared_file_is_named_on_load(base_and_tuned, tmp_path):
    _, _, store, _ = base_and_tuned
    stores = tmp_path / "stores"
    shutil.copytree(store.root.parent, stores)
    bad = stores / "base" / "experts" / "l000_e000.safetensors"
    data = bytearray(bad.read_bytes())
    data[-5] ^= 0xFF
    bad.write_bytes(bytes(data))
    tuned = WeightStore.open(stores / "tuned")  # opening reads indexes only
    with pytest.raises(WeightStoreError, match=r"base/experts/l000_e000\.safetensors: checksum mismatch"):
        tuned.load(0, 0)


def test_model_export_writes_a_fine_tune_s_store_over_its_base_s(tmp_path, capsys):
    """`moeless model export --finetune DIR --base STORE`: only the fine-tune's experts written."""
    from moeless.cli import main
    from moeless.model.finetune import base_record, save_esft

    base = tiny_model("mixtral", 0)
    base.hf.save_pretrained(tmp_path / "model")
    tuned = perturbed(base, CHANGED, 0.01, 1)
    save_esft(tmp_path / "code", tuned, CHANGED, {"name": "code", "base": base_record(base, "tiny"), "task": "none"})
    assert main(["model", "export", "--model", str(tmp_path / "model"), "--out", str(tmp_path / "base")]) == 0
    assert main(["model", "export", "--model", str(tmp_path / "model"), "--finetune", str(tmp_path / "code"),
                 "--base", str(tmp_path / "base"), "--out", str(tmp_path / "store")]) == 0
    assert f"{len(CHANGED)} written, the others its base's" in capsys.readouterr().out
    store = WeightStore.open(tmp_path / "store")
    assert store.model.endswith("+code") and sorted(p.name for p in (tmp_path / "store" / "experts").iterdir()) == \
        [f"l{l:03d}_e{e:03d}.safetensors" for l, e in CHANGED]
    for layer, expert in CHANGED:
        assert torch.equal(store.load(layer, expert)["gate"], tuned.expert_weights(layer, expert)["gate"])
    with pytest.raises(SystemExit) as stop:
        main(["model", "export", "--model", str(tmp_path / "model"), "--base", str(tmp_path / "nothing"),
              "--out", str(tmp_path / "x")])
    assert stop.value.code == 2 and "no weight-store index" in capsys.readouterr().err
