"""The default model: SmolLM2-135M-Instruct with every FFN MoEfied into E experts, top-k routing.

Two cache levels under moeless.paths.cache_dir(), both keyed by CODE_VERSION:
- the conversion, `smollm2-moefy-e{E}-s{seed}-v{V}.safetensors`: neuron partitions [L, E, F] and
  router weights [L, E, H] (independent of k, so every k reuses it);
- the model, `smollm2-moe-e{E}-k{k}-s{seed}-v{V}/`: a moeless-sliced model directory
  (model/sliced_moe.py) with its tokenizer, which model/hf_loader.py also opens.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Iterator

import torch

from moeless.model.moefy import MoefyConfig, balanced_clusters, coactivation, expert_output_norms, neuron_activations, train_router
from moeless.paths import cache_dir

# Bump when the conversion's result changes for the same arguments (invalidates caches).
CODE_VERSION = 1


@dataclass(frozen=True)
class BuildConfig:
    """How the default model is built: calibration data and the conversion's knobs."""

    num_experts: int = 8
    top_k: int = 2
    seed: int = 0
    calib_prompts: int = 256  # ShareGPT "train" prompts
    calib_tokens: int = 64  # each truncated to this many tokens
    moefy: MoefyConfig = MoefyConfig()


def conversion_path(cfg: BuildConfig) -> Path:
    return cache_dir() / f"smollm2-moefy-e{cfg.num_experts}-s{cfg.seed}-v{CODE_VERSION}.safetensors"


def model_path(cfg: BuildConfig) -> Path:
    return cache_dir() / f"smollm2-moe-e{cfg.num_experts}-k{cfg.top_k}-s{cfg.seed}-v{CODE_VERSION}"


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
    from tqdm import tqdm

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
def convert(hf, x: torch.Tensor, cfg: BuildConfig, progress: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """MoEfy every layer of a dense Llama from its FFN inputs.

    x: [L, T, H] -> (neurons [L, E, F] long, routers [L, E, H] float32).
    """
    from tqdm import tqdm

    neurons, routers = [], []
    for l in tqdm(range(len(hf.model.layers)), desc="moefy layers", disable=not progress):
        mlp = hf.model.layers[l].mlp
        gate, up, down = mlp.gate_proj.weight, mlp.up_proj.weight, mlp.down_proj.weight
        # 1. Co-activation of neurons; 2. equal-size groups; 3. a router ranking the groups.
        sim = coactivation(neuron_activations(x[l], gate, up, down), cfg.moefy.active_fraction)
        groups = balanced_clusters(sim, cfg.num_experts, seed=cfg.seed * 1000 + l, iters=cfg.moefy.cluster_iters)
        mass = expert_output_norms(x[l], gate, up, down, groups)
        neurons.append(groups)
        routers.append(train_router(x[l], mass, seed=cfg.seed * 1000 + l, cfg=cfg.moefy))
    return torch.stack(neurons), torch.stack(routers)
