"""A fine-tune directory loaded over its base as one in-process model, ESFT or LoRA: above both
formats' modules (model/finetune.py, model/lora.py), so neither imports the other's loader."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from moeless.model.finetune import merge_experts, read_expert, read_manifest, resolve_base
from moeless.model.lora import load_lora

if TYPE_CHECKING:
    from moeless.model.moe_model import MoEModel


def load_finetune(root: str | Path, base: "MoEModel | None" = None, merge_expert_lora: bool = True) -> "MoEModel":
    """The fine-tune in directory `root` over its base, as one in-process model (base untouched).

    ESFT: the base with its replaced experts swapped in. LoRA: the base with the adapter applied by
    peft; with merge_expert_lora=False the expert LoRAs are not merged but applied at call time
    (moeless.model.lora.load_lora): the same computation an expert host makes, bit for bit.
    base: the base model (None: found from finetune.json, see resolve_base).
    """
    manifest = read_manifest(root)
    base = resolve_base(manifest, base)
    if manifest["method"] == "lora":
        return load_lora(root, manifest, base, merge_experts=merge_expert_lora)
    return merge_experts(base, {(int(e["layer"]), int(e["expert"])): read_expert(root, manifest, e, base.spec)
                                for e in manifest["experts"]})
