"""The default model: SmolLM2-135M-Instruct with every FFN MoEfied into a shared expert of S
neurons and E routed experts, top-k routing.

Built from the dense model (model/gguf_source.py) and real ShareGPT "train" prompts, and cached
in two levels under moeless.core.paths.cache_dir(), keyed by E, S, k, seed, CODE_VERSION and a digest
of the calibration settings:
- the conversion, `smollm2-moefy-e{E}-sh{S}-s{seed}-v{V}-{digest}.safetensors`: shared-expert
  neurons "shared" [L, S], routed partitions "neurons" [L, E, F] and router weights "routers"
  [L, E, H] (independent of k: every k reuses it);
- the model, `smollm2-moe-e{E}-sh{S}-k{k}-s{seed}-v{V}-{digest}/`: a moeless-sliced model
  directory (model/sliced_moe.py) with its tokenizer, which model/hf_loader.py opens.
"""

from __future__ import annotations

import hashlib
import shutil
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Iterator

import torch
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from moeless.core.paths import cache_dir
from moeless.model.datasets import sharegpt_prompts
from moeless.model.gguf_source import load_dense
from moeless.model.hf_loader import load_moe_model
from moeless.model.moefy import (
    MoefyConfig,
    balanced_clusters,
    coactivation,
    expert_output_norms,
    ffn_hidden,
    neuron_activations,
    routed_neurons,
    shared_neurons,
    train_router,
)
from moeless.model.shape import DEFAULT_EXPERTS, DEFAULT_SHARED, DEFAULT_TOP_K, SOURCE_FFN, SOURCE_HIDDEN
from moeless.model.sliced_moe import save_sliced, slice_llama

if TYPE_CHECKING:
    from moeless.model.moe_model import MoEModel

# Bump when the conversion's result changes for the same arguments (invalidates caches).
CODE_VERSION = 2


@dataclass(frozen=True)
class BuildConfig:
    """How the default model is built: its shape, calibration data and the conversion's knobs."""

    num_experts: int = DEFAULT_EXPERTS  # E routed experts per layer
    top_k: int = DEFAULT_TOP_K  # k routed experts per token
    seed: int = 0
    shared_neurons: int = DEFAULT_SHARED  # S neurons of the shared expert (0: none)
    calib_prompts: int = 256  # ShareGPT "train" prompts
    calib_tokens: int = 64  # each truncated to this many tokens
    moefy: MoefyConfig = MoefyConfig()

    def __post_init__(self):
        if not 0 <= self.shared_neurons < SOURCE_FFN:
            raise ValueError(f"the shared expert must have 0..{SOURCE_FFN - 1} neurons, got {self.shared_neurons}")
        routed = SOURCE_FFN - self.shared_neurons
        if self.num_experts < 1 or routed % self.num_experts:
            raise ValueError(
                f"{routed} routed neurons ({SOURCE_FFN} - {self.shared_neurons} shared) do not split into "
                f"{self.num_experts} equal experts; pick E dividing {routed}"
            )
        if not 1 <= self.top_k <= self.num_experts:
            raise ValueError(f"top_k must be in 1..{self.num_experts} (the number of experts), got {self.top_k}")

    @property
    def expert_ffn(self) -> int:
        """F: neurons of one routed expert."""
        return (SOURCE_FFN - self.shared_neurons) // self.num_experts


def expert_shape(cfg: BuildConfig = BuildConfig()) -> tuple[int, int]:
    """(H, F) of one routed expert of the model cfg describes, without building it: (576, 48) by default."""
    return SOURCE_HIDDEN, cfg.expert_ffn


def _digest(cfg: BuildConfig) -> str:
    """8 hex digits over the calibration and conversion settings (everything but E, S, k, seed)."""
    settings = {k: v for k, v in asdict(cfg).items() if k not in ("num_experts", "top_k", "seed", "shared_neurons")}
    return hashlib.sha256(repr(sorted(settings.items())).encode()).hexdigest()[:8]


def conversion_path(cfg: BuildConfig) -> Path:
    name = f"smollm2-moefy-e{cfg.num_experts}-sh{cfg.shared_neurons}-s{cfg.seed}-v{CODE_VERSION}-{_digest(cfg)}"
    return cache_dir() / f"{name}.safetensors"


def model_path(cfg: BuildConfig) -> Path:
    shape = f"e{cfg.num_experts}-sh{cfg.shared_neurons}-k{cfg.top_k}"
    return cache_dir() / f"smollm2-moe-{shape}-s{cfg.seed}-v{CODE_VERSION}-{_digest(cfg)}"


def default_model(
    num_experts: int = DEFAULT_EXPERTS,
    top_k: int = DEFAULT_TOP_K,
    seed: int = 0,
    force: bool = False,
    progress: bool = False,
    shared_neurons: int = DEFAULT_SHARED,
) -> "MoEModel":
    """The default MoEModel (moeless.model.moe_model): loaded from the cache, else built and cached.

    force: rebuild the conversion and the model even when cached.
    """
    cfg = BuildConfig(num_experts, top_k, seed, shared_neurons)
    return load_moe_model(build(cfg, force=force, progress=progress))


def build(cfg: BuildConfig, force: bool = False, progress: bool = False) -> Path:
    """The cached moeless-sliced model directory for cfg, building what is missing."""
    target = model_path(cfg)
    if not force and (target / "config.json").is_file():
        return target
    dense, tokenizer = load_dense()
    shared, neurons, routers = conversion(dense, tokenizer, cfg, force=force, progress=progress)
    hf = slice_llama(dense, neurons, routers, cfg.top_k, shared=shared)
    # Written beside the target first, so an interrupted build never looks cached.
    partial = target.with_name(target.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    save_sliced(hf, partial, tokenizer)
    shutil.rmtree(target, ignore_errors=True)
    partial.rename(target)
    return target


def conversion(dense, tokenizer, cfg: BuildConfig, force: bool = False, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(shared [L, S] long, neurons [L, E, F] long, routers [L, E, H]) for the dense Llama: from the
    cache, else computed and cached."""
    path = conversion_path(cfg)
    if not force and path.is_file():
        saved = load_file(str(path))
        return saved["shared"], saved["neurons"], saved["routers"]
    seqs = encode_prompts(tokenizer, sharegpt_prompts(cfg.calib_prompts, "train"), cfg.calib_tokens)
    x = ffn_inputs(dense, seqs, progress=progress)
    shared, neurons, routers = convert([layer.mlp for layer in dense.model.layers], x, cfg, progress=progress)
    partial = path.with_name(path.name + ".partial")
    save_file({"shared": shared, "neurons": neurons, "routers": routers}, str(partial), metadata={"config": repr(cfg)})
    partial.rename(path)
    return shared, neurons, routers


def encode_prompts(tokenizer, prompts: list[str], max_tokens: int) -> list[torch.Tensor]:
    """Plain-text token ids of each prompt, cut to its first max_tokens tokens: list of [S_i] long."""
    return [torch.tensor(tokenizer(p)["input_ids"][:max_tokens], dtype=torch.long) for p in prompts]


def padded_batches(seqs: list[torch.Tensor], batch_size: int, pad_id: int) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
    """Right-padded batches of similar-length sequences: (ids [B, S], mask [B, S]); order is deterministic."""
    order = sorted(range(len(seqs)), key=lambda i: (len(seqs[i]), i))
    for start in range(0, len(order), batch_size):
        chunk = [seqs[i] for i in order[start : start + batch_size]]
        width = max(len(s) for s in chunk)
        ids = torch.full((len(chunk), width), pad_id, dtype=torch.long)
        mask = torch.zeros((len(chunk), width), dtype=torch.long)
        for row, s in enumerate(chunk):
            ids[row, : len(s)] = s
            mask[row, : len(s)] = 1
        yield ids, mask


@torch.no_grad()
def ffn_inputs(hf, seqs: list[torch.Tensor], batch_size: int = 32, progress: bool = False) -> torch.Tensor:
    """The input of every decoder layer's FFN on every real (unpadded) token.

    hf: a dense LlamaForCausalLM; seqs: list of [S_i] -> [L, T, H], T = sum of S_i.
    """
    layers = hf.model.layers
    captured: list[list[torch.Tensor]] = [[] for _ in layers]
    keep: list[torch.Tensor] = []

    def hook(index: int):
        return lambda module, args: captured[index].append(args[0][keep[0]])

    handles = [layer.mlp.register_forward_pre_hook(hook(i)) for i, layer in enumerate(layers)]
    try:
        batches = list(padded_batches(seqs, batch_size, pad_id=0))
        for ids, mask in tqdm(batches, desc="calibration forward", disable=not progress):
            keep[:] = [mask.bool()]
            hf.model(input_ids=ids, attention_mask=mask)
    finally:
        for h in handles:
            h.remove()
    return torch.stack([torch.cat(chunks) for chunks in captured])


@torch.no_grad()
def convert(mlps: list, x: torch.Tensor, cfg: BuildConfig, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """MoEfy the dense FFNs (LlamaMLP modules) of layers 0..L-1 from their inputs.

    x: [L, T, H] -> (shared [L, S] long, neurons [L, E, F] long, routers [L, E, H] float32).
    """
    shared, neurons, routers = [], [], []
    for l, mlp in enumerate(tqdm(mlps, desc="moefy layers", disable=not progress)):
        gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        # 1. The hottest neurons form the shared expert; 2. co-activation of the others;
        # 3. equal-size groups of them; 4. a router ranking the groups.
        h = ffn_hidden(x[l], gate, up)
        acts = neuron_activations(h, down)
        always = shared_neurons(acts, cfg.shared_neurons)
        rest = routed_neurons(acts.shape[1], always)
        sim = coactivation(acts[:, rest], cfg.moefy.active_fraction)
        groups = rest[balanced_clusters(sim, cfg.num_experts, seed=cfg.seed * 1000 + l, iters=cfg.moefy.cluster_iters)]
        mass = expert_output_norms(h, down, groups)
        shared.append(always)
        neurons.append(groups)
        routers.append(train_router(x[l], mass, cfg.moefy))
    return torch.stack(shared), torch.stack(neurons), torch.stack(routers)
