"""Load a Hugging Face MoE checkpoint, or a moeless-sliced model, from a local directory.

No hub access: `path` must be a directory holding config.json and safetensors weights (one
model.safetensors, or shards listed in model.safetensors.index.json). The architecture is picked
from config.json; the model is loaded in float32 with transformers' eager experts (the fastest
on CPU).
"""

from __future__ import annotations

import json
from pathlib import Path

from safetensors import safe_open

from moeless.model.adapters import ARCHS
from moeless.model.moe_model import MoEModel
from moeless.model.sliced_moe import WEIGHTS_FILE, SlicedModelError, is_sliced_config, load_sliced

SHARD_INDEX = "model.safetensors.index.json"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


class ModelLoadError(RuntimeError):
    """A model directory is missing, unsupported or damaged."""


def load_moe_model(path: str | Path) -> MoEModel:
    """The MoEModel stored in directory `path` (with its tokenizer when the directory has one)."""
    path = Path(path)
    config = read_config(path)
    for weights in weight_files(path):
        check_safetensors(weights)
    if is_sliced_config(config):
        try:
            hf = load_sliced(path)
        except SlicedModelError as err:
            raise ModelLoadError(str(err)) from err
    else:
        hf = _load_transformers(path, config)
    hf.config.name_or_path = str(path)  # what from_pretrained records; a saved sliced config names its dense source
    return MoEModel(hf, tokenizer=_load_tokenizer(path))


def read_config(path: Path) -> dict:
    """config.json of model directory `path`, checked for a supported architecture."""
    if not path.is_dir():
        raise ModelLoadError(f"{path}: no such model directory")
    config_path = path / "config.json"
    if not config_path.is_file():
        raise ModelLoadError(f"{config_path}: missing; a model directory needs config.json and safetensors weights")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise ModelLoadError(f"{config_path}: not valid JSON ({err})") from err
    if not is_sliced_config(config) and config.get("model_type") not in ARCHS:
        raise ModelLoadError(
            f"{config_path}: unsupported model_type {config.get('model_type')!r}; supported: {', '.join(ARCHS)}"
        )
    return config


def weight_files(path: Path) -> list[Path]:
    """The safetensors files of model directory `path` (the single file or every listed shard)."""
    index = path / SHARD_INDEX
    if index.is_file():
        try:
            shards = sorted(set(json.loads(index.read_text())["weight_map"].values()))
        except (json.JSONDecodeError, KeyError) as err:
            raise ModelLoadError(f"{index}: not a valid shard index ({err!r})") from err
        files = [path / s for s in shards]
    else:
        files = [path / WEIGHTS_FILE]
    for f in files:
        if not f.is_file():
            raise ModelLoadError(f"{f}: weight file is missing (only safetensors checkpoints are supported)")
    return files


def check_safetensors(file: Path) -> None:
    """Read file's header and every tensor's extent; a ModelLoadError naming it if damaged.

    safetensors has no checksum: flipped bytes inside tensor data go unnoticed; a damaged
    header or a truncated file is caught here.
    """
    try:
        with safe_open(str(file), framework="pt") as f:
            for key in f.keys():
                f.get_slice(key).get_shape()
    except Exception as err:  # safetensors raises several types for damaged files
        raise ModelLoadError(f"{file}: corrupt safetensors file ({err}); re-download or re-save the model") from err


def _load_transformers(path: Path, config: dict):
    import torch
    from transformers import AutoModelForCausalLM

    try:
        hf = AutoModelForCausalLM.from_pretrained(str(path), dtype=torch.float32, experts_implementation="eager")
    except Exception as err:  # transformers wraps file and shape problems in many types
        raise ModelLoadError(f"{path}: transformers could not load this {config['model_type']} checkpoint ({err})") from err
    return hf.eval()


def _load_tokenizer(path: Path):
    if not any((path / name).is_file() for name in TOKENIZER_FILES):
        return None
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(str(path))
