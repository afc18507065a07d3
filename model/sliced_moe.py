"""The "moeless-sliced" architecture: a Llama whose dense FFNs are cut into neuron-slice experts.

Every decoder layer's `mlp` (a LlamaMLP with F_dense neurons) becomes a SlicedMoE block: the
neurons are partitioned into a shared expert of S neurons, which runs on every token (as in
DeepSeek-MoE and Qwen2-MoE), and E routed slices of F = (F_dense - S) / E neurons each; a router
picks k routed slices per token. The slices of a SwiGLU FFN add up to the FFN
(down(act(gate x) * up x) is a sum over neurons), so every chosen expert's output is added with
weight 1.0 and with k = E the block equals the dense FFN it came from.

Saved as a directory: config.json (the Llama config plus a "moeless" section), model.safetensors
(parameters, tied embeddings stored once), and the tokenizer's files when one is given.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from safetensors.torch import load_model, save_model
from torch import nn

from moeless.model.experts import expert_forward

ARCH = "moeless-sliced"
CONFIG_SECTION = "moeless"
WEIGHTS_FILE = "model.safetensors"

# transformers' activation names -> moeless.model.experts.ACTIVATIONS keys
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh", "relu": "relu"}


class SlicedModelError(RuntimeError):
    """A moeless-sliced model directory or its inputs are invalid."""


def expert_act(hidden_act: str) -> str:
    """The moeless activation name for a transformers `hidden_act`; a clear error if unsupported."""
    try:
        return HF_ACTIVATIONS[hidden_act]
    except KeyError:
        raise ValueError(f"expert activation {hidden_act!r} is not supported; supported: {sorted(HF_ACTIVATIONS)}") from None


class SlicedMoE(nn.Module):
    """Neuron-slice experts of one dense SwiGLU FFN: an optional shared expert plus E routed ones.

    router: Linear(H, E, bias=False); gate_proj: [E, F, H]; up_proj: [E, F, H]; down_proj: [E, H, F]
    (expert e's slice is exactly moeless.model.experts' canonical {"gate", "up", "down"});
    with shared_ffn S > 0, shared_gate: [S, H]; shared_up: [S, H]; shared_down: [H, S].
    Routing: the k largest router logits per token, each chosen expert with combine weight 1.0;
    the shared expert is added on every token.
    """

    def __init__(self, hidden_size: int, num_experts: int, expert_ffn: int, top_k: int, act: str = "silu", shared_ffn: int = 0):
        super().__init__()
        if not 1 <= top_k <= num_experts:
            raise SlicedModelError(f"top_k must be in 1..{num_experts} (the number of experts), got {top_k}")
        if shared_ffn < 0:
            raise SlicedModelError(f"shared_ffn must be >= 0 neurons, got {shared_ffn}")
        self.num_experts, self.top_k, self.act, self.shared_ffn = num_experts, top_k, act, shared_ffn
        self.router = nn.Linear(hidden_size, num_experts, bias=False)
        self.gate_proj = nn.Parameter(torch.empty(num_experts, expert_ffn, hidden_size))
        self.up_proj = nn.Parameter(torch.empty(num_experts, expert_ffn, hidden_size))
        self.down_proj = nn.Parameter(torch.empty(num_experts, hidden_size, expert_ffn))
        if shared_ffn:
            self.shared_gate = nn.Parameter(torch.empty(shared_ffn, hidden_size))
            self.shared_up = nn.Parameter(torch.empty(shared_ffn, hidden_size))
            self.shared_down = nn.Parameter(torch.empty(hidden_size, shared_ffn))

    @staticmethod
    def from_dense(
        mlp: nn.Module, neurons: torch.Tensor, router: torch.Tensor, top_k: int, act: str, shared: torch.Tensor | None = None
    ) -> "SlicedMoE":
        """Slice a LlamaMLP. neurons: [E, F] long and shared: [S] long (None: S = 0), together a
        partition of its F_dense neurons; router: [E, H]."""
        f_dense, hidden = mlp.gate_proj.weight.shape
        num_experts, expert_ffn = neurons.shape
        shared = torch.zeros(0, dtype=torch.long) if shared is None else shared
        if mlp.gate_proj.bias is not None:
            raise SlicedModelError("the dense FFN has biases (mlp_bias=True); only bias-free Llama FFNs can be sliced")
        if sorted(neurons.flatten().tolist() + shared.tolist()) != list(range(f_dense)):
            raise SlicedModelError(
                f"neurons [{num_experts}, {expert_ffn}] and shared [{len(shared)}] must be a partition of the FFN's "
                f"{f_dense} neurons (each index exactly once)"
            )
        if tuple(router.shape) != (num_experts, hidden):
            raise SlicedModelError(f"router weights must be [{num_experts}, {hidden}] (experts, hidden), got {list(router.shape)}")
        block = SlicedMoE(hidden, num_experts, expert_ffn, top_k, act, shared_ffn=len(shared))
        with torch.no_grad():
            block.router.weight.copy_(router)
            block.gate_proj.copy_(mlp.gate_proj.weight[neurons])  # [E, F, H]
            block.up_proj.copy_(mlp.up_proj.weight[neurons])  # [E, F, H]
            block.down_proj.copy_(mlp.down_proj.weight[:, neurons].permute(1, 0, 2))  # [H, E, F] -> [E, H, F]
            if len(shared):
                block.shared_gate.copy_(mlp.gate_proj.weight[shared])  # [S, H]
                block.shared_up.copy_(mlp.up_proj.weight[shared])  # [S, H]
                block.shared_down.copy_(mlp.down_proj.weight[:, shared])  # [H, S]
        return block

    def expert(self, e: int) -> dict[str, torch.Tensor]:
        """Expert e in canonical form: {"gate": [F, H], "up": [F, H], "down": [H, F]} (views)."""
        return {"gate": self.gate_proj[e], "up": self.up_proj[e], "down": self.down_proj[e]}

    def shared_forward(self, x: torch.Tensor) -> torch.Tensor | None:
        """The shared expert on x: [T, H] -> [T, H]; None without one."""
        if not self.shared_ffn:
            return None
        return expert_forward({"gate": self.shared_gate, "up": self.shared_up, "down": self.shared_down}, x, self.act)

    def route(self, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [T, E] -> (idx [T, k] long, weight [T, k] all 1.0)."""
        idx = torch.topk(logits, self.top_k, dim=-1).indices
        return idx, torch.ones(idx.shape, dtype=logits.dtype, device=logits.device)

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [B, S, H] -> [B, S, H]."""
        shape = hidden_states.shape
        x = hidden_states.reshape(-1, shape[-1])
        idx, _ = self.route(self.router(x))
        out = torch.zeros_like(x)
        for e in torch.unique(idx).tolist():
            tokens = (idx == e).any(dim=-1).nonzero().squeeze(-1)
            out.index_put_((tokens,), expert_forward(self.expert(e), x[tokens], self.act), accumulate=True)
        shared = self.shared_forward(x)
        if shared is not None:
            out = out + shared
        return out.reshape(shape)


def slice_llama(hf: nn.Module, neurons: torch.Tensor, routers: torch.Tensor, top_k: int, shared: torch.Tensor | None = None) -> nn.Module:
    """Turn a dense LlamaForCausalLM into a moeless-sliced model, in place; returns it.

    neurons: [L, E, F] long and shared: [L, S] long (None: no shared expert), per decoder layer
    together a partition of the FFN's neurons; routers: [L, E, H] router weights. Records the
    "moeless" config section.
    """
    layers = hf.model.layers
    if neurons.dim() != 3 or neurons.shape[0] != len(layers):
        raise SlicedModelError(f"neurons must be [L={len(layers)}, E, F], got {list(neurons.shape)}")
    if routers.dim() != 3 or routers.shape[:2] != neurons.shape[:2]:
        raise SlicedModelError(
            f"routers must be [L, E, H] = [{neurons.shape[0]}, {neurons.shape[1]}, H], got {list(routers.shape)}"
        )
    if shared is None:
        shared = torch.zeros(len(layers), 0, dtype=torch.long)
    if shared.dim() != 2 or shared.shape[0] != len(layers):
        raise SlicedModelError(f"shared must be [L={len(layers)}, S], got {list(shared.shape)}")
    act = expert_act(hf.config.hidden_act)
    for layer, part, router, always in zip(layers, neurons, routers, shared):
        layer.mlp = SlicedMoE.from_dense(layer.mlp, part, router.to(hf.dtype), top_k, act, shared=always)
    num_experts, expert_ffn = int(neurons.shape[1]), int(neurons.shape[2])
    hf.config.moeless = {
        "arch": ARCH, "num_experts": num_experts, "top_k": int(top_k), "expert_ffn": expert_ffn, "shared_ffn": int(shared.shape[1]),
    }
    return hf


def is_sliced_config(config: dict) -> bool:
    """Whether a config.json dict describes a moeless-sliced model."""
    return isinstance(config.get(CONFIG_SECTION), dict) and config[CONFIG_SECTION].get("arch") == ARCH


def save_sliced(hf: nn.Module, path: str | Path, tokenizer=None) -> Path:
    """Write a moeless-sliced model (and its tokenizer, if given) to directory `path`."""
    if not isinstance(getattr(hf.config, CONFIG_SECTION, None), dict):
        raise SlicedModelError("not a moeless-sliced model (no 'moeless' config section); build one with slice_llama()")
    path = Path(path)
    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps(hf.config.to_dict(), indent=1))
    save_model(hf, str(path / WEIGHTS_FILE))  # stores tied embeddings once
    if tokenizer is not None:
        tokenizer.save_pretrained(str(path))
    return path


def load_sliced(path: str | Path) -> nn.Module:
    """Load a moeless-sliced LlamaForCausalLM (float32, eval mode) from directory `path`."""
    from transformers import LlamaConfig

    path = Path(path)
    config_path = path / "config.json"
    if not config_path.is_file():
        raise SlicedModelError(f"{config_path}: missing; is {path} a moeless-sliced model directory?")
    raw = json.loads(config_path.read_text())
    if not is_sliced_config(raw):
        raise SlicedModelError(f"{config_path}: no 'moeless' section with arch {ARCH!r}")
    section = raw[CONFIG_SECTION]
    config = LlamaConfig.from_dict(raw)
    hf = _empty_sliced(config, section["num_experts"], section["expert_ffn"], section["top_k"], section.get("shared_ffn", 0))
    weights = path / WEIGHTS_FILE
    if not weights.is_file():
        raise SlicedModelError(f"{weights}: missing weight file")
    try:
        load_model(hf, str(weights), strict=True)
    except Exception as err:  # safetensors raises several types for damaged files
        raise SlicedModelError(f"{weights}: cannot load weights ({err}); the file is corrupt or from another model") from err
    return hf.float().eval()


def _empty_sliced(config, num_experts: int, expert_ffn: int, top_k: int, shared_ffn: int) -> nn.Module:
    """A LlamaForCausalLM of `config` with SlicedMoE blocks and placeholder weights, to be overwritten by loading."""
    from transformers import LlamaForCausalLM
    from transformers.initialization import no_init_weights

    with no_init_weights():  # random initialisation of 135M parameters took 4 s
        hf = LlamaForCausalLM(config)
    hf.tie_weights()  # skipped along with the initialisation
    act = expert_act(config.hidden_act)
    for layer in hf.model.layers:
        layer.mlp = SlicedMoE(config.hidden_size, num_experts, expert_ffn, top_k, act, shared_ffn)
    return hf
