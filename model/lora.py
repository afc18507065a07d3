"""LoRA fine-tunes in PEFT's own format: trained with peft, loaded with peft, experts at call time.

The adapter is a standard PEFT folder (adapter_config.json + adapter_model.safetensors) inside the
fine-tune directory (model/finetune.py). Targets on the default model (moeless-sliced):
- "attention": the Linear modules q_proj, k_proj, v_proj, o_proj (peft's target_modules);
- "experts": the routed experts, which are stacked parameters of SlicedMoE, not modules, so
  peft's target_parameters ("mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"): peft 0.21's
  ParamWrapper gives each of the E experts its own rank-r factors, laid out as
  lora_A [r E, in] (expert e: rows e r .. e r + r - 1) and lora_B [out, r E] (expert e: columns
  e, e + E, ...), and nests one wrapper per parameter (the first parameter innermost, keys
  "mlp.base_layer.base_layer.lora_A.weight" for gate_proj when all three are targeted);
- "both".
peft is pinned (pyproject) because expert_loras reads that layout; the test against peft's own
forward fails if a peft release changes it.
"""

from __future__ import annotations

import copy
import json
import re
import time
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import torch
from peft import LoraConfig, PeftModel, get_peft_model
from peft.tuners.lora.layer import LoraLayer, ParamWrapper
from safetensors import SafetensorError
from safetensors.torch import load_file
from tqdm import tqdm

from moeless.model.esft import TrainConfig, batches, loss_summary
from moeless.model.experts import expert_forward_lora, lora_tensor_names
from moeless.model.finetune import FinetuneError, write_manifest
from moeless.model.moe_model import LocalExecutor, MoEModel
from moeless.model.sliced_moe import SlicedMoE

if TYPE_CHECKING:
    from peft import PeftModel as PeftModelType

ATTENTION = ("q_proj", "k_proj", "v_proj", "o_proj")
# SlicedMoE's expert parameters in registration order (peft nests wrappers in it) -> canonical names
EXPERT_PARAMS = {"gate_proj": "gate", "up_proj": "up", "down_proj": "down"}
TARGETS = ("attention", "experts", "both")
ADAPTER_DIR = "adapter"
CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
PREFIX = "base_model.model."


def lora_config(targets: str, rank: int, alpha: float | None = None) -> LoraConfig:
    """peft's LoraConfig for `targets` ("attention", "experts" or "both"); alpha defaults to 2 rank.
    Dropout 0: peft's ParamWrapper (the experts) supports no other."""
    if targets not in TARGETS:
        raise ValueError(f"targets must be one of {TARGETS}, got {targets!r}")
    modules = list(ATTENTION) if targets in ("attention", "both") else []  # [] not None: None means peft's defaults
    params = [f"mlp.{p}" for p in EXPERT_PARAMS] if targets in ("experts", "both") else None
    return LoraConfig(r=rank, lora_alpha=alpha or 2 * rank, target_modules=modules, target_parameters=params,
                      lora_dropout=0.0, bias="none")


def train_lora(model: MoEModel, targets: str, rank: int, blocks: torch.Tensor, cfg: TrainConfig = TrainConfig(),
               progress: bool = False) -> tuple["PeftModelType", dict]:
    """A LoRA adapter trained with peft on a copy of model.hf (model untouched) on next-token loss
    over blocks ([N, S] ids); the same batches and optimizer as ESFT (model/esft.py).
    -> (the PeftModel, {"steps", "tokens", "seconds", "cpu_seconds", "loss_start", "loss_end", "parameters"})."""
    if not isinstance(model.hf.model.layers[model.spec.moe_layer_ids[0]].mlp, SlicedMoE) and targets != "attention":
        raise ValueError(f"expert LoRA needs the moeless-sliced arch (the default model), not {model.spec.arch!r}")
    torch.manual_seed(cfg.seed)  # peft's initialisation of lora_A
    with warnings.catch_warnings():  # peft calls transformers' deprecated is_gradient_checkpointing
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = get_peft_model(copy.deepcopy(model.hf), lora_config(targets, rank))
    params = [p for p in peft_model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=cfg.lr, weight_decay=0.0)
    losses, start, cpu = [], time.perf_counter(), time.process_time()
    for ids in tqdm(batches(blocks, cfg), total=cfg.steps, desc="LoRA steps", disable=not progress):
        loss = peft_model(input_ids=ids, labels=ids).loss
        optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, 1.0)
        optimizer.step()
        losses.append(float(loss.detach()))
    stats = {"steps": cfg.steps, "tokens": cfg.steps * cfg.batch * int(blocks.shape[1]),
             "seconds": round(time.perf_counter() - start, 1),
             "cpu_seconds": round(time.process_time() - cpu, 1), **loss_summary(losses),
             "parameters": sum(p.numel() for p in params)}
    return peft_model, stats


def merged_model(peft_model: "PeftModelType", tokenizer=None) -> MoEModel:
    """The trained adapter merged by peft into a copy of its model, as a MoEModel."""
    return MoEModel(copy.deepcopy(peft_model).merge_and_unload(), tokenizer=tokenizer)


def save_lora(out: str | Path, peft_model: "PeftModelType", manifest: dict) -> Path:
    """Write a LoRA fine-tune: peft's adapter folder under out/adapter and finetune.json."""
    peft_model.save_pretrained(str(Path(out) / ADAPTER_DIR))
    return write_manifest(out, {**manifest, "method": "lora", "experts": []})


def adapts_non_experts(root: str | Path) -> bool:
    """Whether the LoRA fine-tune in directory root adapts modules besides the routed experts (target_modules:
    attention): its non-expert layers then differ from its base's. An unreadable config: True (the loader
    refuses it, naming the file)."""
    try:
        config = json.loads((Path(root) / ADAPTER_DIR / CONFIG_FILE).read_text())
    except (OSError, ValueError):
        return True
    return not isinstance(config, dict) or bool(config.get("target_modules"))


def _expected_shapes(config: dict, base: MoEModel, where: Path) -> dict[str, tuple[int, int]]:
    """{adapter tensor key: shape} that the adapter's config asks for on base; unknown targets refused."""
    r, spec = int(config["r"]), base.spec
    shapes: dict[str, tuple[int, int]] = {}
    modules = config.get("target_modules") or []
    names = dict(base.hf.named_modules())
    for target in [modules] if isinstance(modules, str) else modules:
        hits = [n for n, m in names.items() if isinstance(m, torch.nn.Linear) and
                (re.fullmatch(target, n) if isinstance(modules, str) else (n == target or n.endswith(f".{target}")))]
        if not hits:
            raise FinetuneError(f"{where}: target module {target!r} is not a Linear module of base {spec.arch} "
                                f"(e.g. {', '.join(ATTENTION)})")
        for n in hits:
            out_f, in_f = names[n].weight.shape
            shapes[f"{PREFIX}{n}.lora_A.weight"], shapes[f"{PREFIX}{n}.lora_B.weight"] = (r, in_f), (out_f, r)
    targeted = []
    for target in config.get("target_parameters") or []:
        param = target.rpartition(".")[2]
        if param not in EXPERT_PARAMS or (target != param and not target.endswith(f"mlp.{param}")):
            raise FinetuneError(f"{where}: target parameter {target!r} is not an expert parameter of base "
                                f"{spec.arch} (mlp.gate_proj, mlp.up_proj, mlp.down_proj)")
        targeted.append(param)
    targeted = [p for p in EXPERT_PARAMS if p in targeted]  # peft's nesting follows registration order
    io = {"gate_proj": (spec.hidden_size, spec.expert_ffn), "up_proj": (spec.hidden_size, spec.expert_ffn),
          "down_proj": (spec.expert_ffn, spec.hidden_size)}
    for layer in spec.moe_layer_ids if targeted else ():
        for depth, param in enumerate(reversed(targeted)):
            key = f"{PREFIX}model.layers.{layer}.mlp.{'base_layer.' * depth}"
            in_f, out_f = io[param]
            shapes[key + "lora_A.weight"], shapes[key + "lora_B.weight"] = (r * spec.num_experts, in_f), (out_f, r * spec.num_experts)
    return shapes


def read_adapter(adapter_dir: str | Path, base: MoEModel) -> tuple[dict, dict[str, torch.Tensor]]:
    """A PEFT LoRA folder's config and tensors, checked against base; anything malformed (missing
    file, not peft's LoRA format, unknown targets, wrong shapes) refused in one line naming the file."""
    adapter_dir = Path(adapter_dir)
    config_path, weights_path = adapter_dir / CONFIG_FILE, adapter_dir / WEIGHTS_FILE
    if not config_path.is_file():
        raise FinetuneError(f"{config_path}: missing; a PEFT adapter folder needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as err:
        raise FinetuneError(f"{config_path}: not valid JSON ({err})") from err
    if not isinstance(config, dict) or config.get("peft_type") != "LORA" or not isinstance(config.get("r"), int):
        raise FinetuneError(f"{config_path}: not a PEFT LoRA config (needs peft_type 'LORA' and an integer r)")
    unsupported = [k for k in ("use_dora", "rank_pattern", "alpha_pattern", "modules_to_save", "layers_to_transform")
                   if config.get(k)]
    if unsupported or config.get("bias", "none") != "none":
        raise FinetuneError(f"{config_path}: {', '.join(unsupported) or 'bias'} not supported (plain LoRA only)")
    expected = _expected_shapes(config, base, config_path)
    if not weights_path.is_file():
        raise FinetuneError(f"{weights_path}: missing; a PEFT adapter folder needs {CONFIG_FILE} and {WEIGHTS_FILE}")
    try:
        tensors = load_file(str(weights_path))
    except (SafetensorError, OSError) as err:
        raise FinetuneError(f"{weights_path}: not a readable safetensors file ({err})") from err
    for key in sorted(set(expected) | set(tensors)):
        if key not in tensors:
            raise FinetuneError(f"{weights_path}: lacks {key}, which {CONFIG_FILE} targets")
        if key not in expected:
            raise FinetuneError(f"{weights_path}: {key} is not a target of {CONFIG_FILE} on this base")
        if tuple(tensors[key].shape) != expected[key]:
            raise FinetuneError(f"{weights_path}: {key} is {list(tensors[key].shape)} but the base needs {list(expected[key])}")
    return config, tensors


def expert_loras(adapter_dir: str | Path, base: MoEModel) -> dict[tuple[int, int], dict[str, torch.Tensor]]:
    """Every expert's LoRA in a PEFT adapter, for expert_forward_lora: {(layer, expert): {"gate_A"
    [r, H], "gate_B" [F, r], "up_A", "up_B", "down_A" [r, F], "down_B" [H, r]}} (only the adapted
    matrices), each B already scaled by lora_alpha / r (/ sqrt(r) with use_rslora). Checked as
    read_adapter checks; empty for an attention-only adapter. Layers are MoE-layer indices."""
    config, tensors = read_adapter(adapter_dir, base)
    r, spec = int(config["r"]), base.spec
    scale = config["lora_alpha"] / (r ** 0.5 if config.get("use_rslora") else r)
    targeted = [p for p in EXPERT_PARAMS if any(t.rpartition(".")[2] == p for t in config.get("target_parameters") or [])]
    loras: dict[tuple[int, int], dict[str, torch.Tensor]] = {}
    for layer, decoder_layer in enumerate(spec.moe_layer_ids if targeted else ()):
        for depth, param in enumerate(reversed(targeted)):
            key = f"{PREFIX}model.layers.{decoder_layer}.mlp.{'base_layer.' * depth}"
            a = tensors[key + "lora_A.weight"].reshape(spec.num_experts, r, -1)  # [E, r, in]
            b = tensors[key + "lora_B.weight"].reshape(-1, r, spec.num_experts)  # [out, r, E]
            name_a, name_b = lora_tensor_names(EXPERT_PARAMS[param])
            for e in range(spec.num_experts):
                lora = loras.setdefault((layer, e), {})
                lora[name_a], lora[name_b] = a[e].contiguous(), (b[:, :, e] * scale).contiguous()
    return loras


class LoraExecutor(LocalExecutor):
    """The in-process executor with expert LoRAs applied at call time (expert_forward_lora) over
    the base's own expert weights: what an expert host computes for a LoRA fine-tune."""

    def __init__(self, expert_weights, act: str, loras: dict[tuple[int, int], dict[str, torch.Tensor]]):
        super().__init__(expert_weights, act)
        self.loras = loras

    def expert_output(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        lora = self.loras.get((layer, expert))
        if lora is None:
            return super().expert_output(layer, expert, x)
        return expert_forward_lora(self.expert_weights(layer, expert), lora, x, self.act)


class LoraMoEModel(MoEModel):
    """A MoEModel whose non-expert LoRAs are merged and whose expert LoRAs run at call time:
    forward and generate use LoraExecutor unless given another executor. `expert_loras` holds
    them ({(layer, expert): LoRA dict}) for expert hosts."""

    def __init__(self, hf: torch.nn.Module, tokenizer, loras: dict[tuple[int, int], dict[str, torch.Tensor]]):
        super().__init__(hf, tokenizer=tokenizer)
        self.expert_loras = loras

    def local_executor(self) -> LoraExecutor:
        return LoraExecutor(self.expert_weights, self.spec.act, self.expert_loras)


def load_lora(root: str | Path, manifest: dict, base: MoEModel, merge_experts: bool = True) -> MoEModel:
    """A LoRA fine-tune over a copy of base, the adapter applied by peft (PeftModel.from_pretrained)
    after read_adapter's checks. merge_experts: every LoRA merged into the copy's weights (peft's
    merge_and_unload); else only the non-expert ones, and a LoraMoEModel applies the expert LoRAs
    at call time."""
    adapter_dir = Path(root) / ADAPTER_DIR
    loras = expert_loras(adapter_dir, base)  # checks the folder before peft sees it
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", FutureWarning)
        peft_model = PeftModel.from_pretrained(copy.deepcopy(base.hf), str(adapter_dir))
    if merge_experts or not loras:
        return MoEModel(peft_model.merge_and_unload(), tokenizer=base.tokenizer)
    for module in peft_model.modules():
        if isinstance(module, LoraLayer) and not isinstance(module, ParamWrapper):
            module.merge()
    return LoraMoEModel(peft_model.unload(), base.tokenizer, loras)
