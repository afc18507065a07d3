"""Per-architecture readers of MoE blocks: where the gate and experts live, and how each routes.

An adapter knows, for one architecture, which decoder-layer `mlp` modules are MoE blocks, the
gate's weight, the routing rule from gate logits (exactly as the installed transformers 5.x
class computes it in eval mode), the experts in canonical form (moeless.model.experts), and
the shared experts. transformers 5.x stores experts fused: experts.gate_up_proj [E, 2F, H]
(gate rows first, then up rows) and experts.down_proj [E, H, F].
"""

from __future__ import annotations

import torch
from torch import nn

from moeless.model.sliced_moe import ARCH as SLICED_ARCH
from moeless.model.sliced_moe import CONFIG_SECTION, SlicedMoE, expert_act

Expert = dict[str, torch.Tensor]


class ExpertsDroppedError(RuntimeError):
    """The routed experts were freed with drop_experts(); they must run on a remote executor."""


def softmax_topk(logits: torch.Tensor, k: int, renormalise: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """Softmax over experts, top-k, optionally renormalised to sum 1 (Mixtral, Qwen-MoE, OLMoE).

    logits: [T, E] -> (idx [T, k], weight [T, k]).
    """
    probs = torch.softmax(logits, dim=-1, dtype=torch.float)
    weight, idx = torch.topk(probs, k, dim=-1)
    if renormalise:
        weight = weight / weight.sum(dim=-1, keepdim=True)
    return idx, weight.to(logits.dtype)


def group_mask(scores: torch.Tensor, group_scores: torch.Tensor, topk_group: int) -> torch.Tensor:
    """Keep only experts of the topk_group best groups. scores: [T, E]; group_scores: [T, G] -> [T, E] bool."""
    groups = group_scores.shape[-1]
    chosen = torch.topk(group_scores, k=topk_group, dim=-1, sorted=False).indices
    mask = torch.zeros_like(group_scores).scatter_(1, chosen, 1.0)
    return mask.unsqueeze(-1).expand(-1, groups, scores.shape[-1] // groups).reshape(scores.shape).bool()


class MoEArch:
    """Reader of one architecture's MoE blocks (the fused-experts transformers 5.x layout).

    Subclasses override the routing rule, the gate's location and shared experts.
    """

    name = ""

    def __init__(self, config):
        self.config = config
        self.top_k = self.experts_per_token(config)
        self.act = expert_act(config.hidden_act)

    def experts_per_token(self, config) -> int:
        return int(config.num_experts_per_tok)

    def is_moe_block(self, mlp: nn.Module) -> bool:
        return hasattr(mlp, "experts") and hasattr(mlp.experts, "gate_up_proj")

    def gate_weight(self, block: nn.Module) -> nn.Parameter:
        """The gate's weight: [E, H] (logits = x @ weight.T)."""
        return block.gate.weight

    def num_experts(self, block: nn.Module) -> int:
        return int(self.gate_weight(block).shape[0])

    def expert_ffn(self, block: nn.Module) -> int:
        return int(block.experts.down_proj.shape[-1])

    def route(self, block: nn.Module, logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """logits: [T, E] -> (idx [T, k], weight [T, k])."""
        return softmax_topk(logits, self.top_k, renormalise=bool(getattr(self.config, "norm_topk_prob", True)))

    def expert(self, block: nn.Module, e: int) -> Expert:
        """Expert e: {"gate": [F, H], "up": [F, H], "down": [H, F]} (views of the block's weights)."""
        gate_up, down = block.experts.gate_up_proj, block.experts.down_proj
        if gate_up.numel() == 0:
            raise ExpertsDroppedError("routed experts were dropped (drop_experts()); run this model with a remote executor")
        f = down.shape[-1]
        return {"gate": gate_up[e, :f], "up": gate_up[e, f:], "down": down[e]}

    def shared(self, block: nn.Module, x: torch.Tensor) -> torch.Tensor | None:
        """The shared experts' output for x: [T, H] -> [T, H], or None when there are none."""
        return None

    def shared_ffn(self, block: nn.Module) -> int:
        """Neurons of the block's shared experts (0: none)."""
        mlp = getattr(block, "shared_expert", None) or getattr(block, "shared_experts", None)
        return 0 if mlp is None else int(mlp.down_proj.weight.shape[-1])

    def drop_experts(self, block: nn.Module) -> None:
        block.experts.gate_up_proj = nn.Parameter(torch.empty(0), requires_grad=False)
        block.experts.down_proj = nn.Parameter(torch.empty(0), requires_grad=False)


class MixtralArch(MoEArch):
    name = "mixtral"

    def route(self, block, logits):
        return softmax_topk(logits, self.top_k, renormalise=True)


class Qwen2MoeArch(MoEArch):
    """Qwen2-MoE: a shared expert scaled by sigmoid(shared_expert_gate(x))."""

    name = "qwen2_moe"

    def shared(self, block, x):
        return torch.sigmoid(block.shared_expert_gate(x)) * block.shared_expert(x)


class Qwen3MoeArch(MoEArch):
    name = "qwen3_moe"


class OlmoeArch(MoEArch):
    name = "olmoe"


class PhimoeArch(MoEArch):
    """Phi-3.5-MoE: SparseMixer top-2 (eval mode: deterministic), gate at block.router."""

    name = "phimoe"

    def experts_per_token(self, config):
        return 2  # SparseMixer always picks two experts, whatever num_experts_per_tok says

    def gate_weight(self, block):
        return block.router.weight

    def route(self, block, logits):
        from transformers.models.phimoe.modeling_phimoe import sparsemixer

        weight, idx = sparsemixer(logits, jitter_eps=self.config.router_jitter_noise, training=False, top_k=self.top_k)
        return idx, weight


class DeepseekV2Arch(MoEArch):
    """DeepSeek-V2: softmax, greedy or group-limited greedy top-k, times routed_scaling_factor; shared experts."""

    name = "deepseek_v2"

    def route(self, block, logits):
        c = self.config
        scores = logits.float().softmax(dim=-1)
        if c.topk_method == "group_limited_greedy":
            groups = scores.view(-1, c.n_group, scores.shape[-1] // c.n_group).max(dim=-1).values
            scores = scores.masked_fill(~group_mask(scores, groups, c.topk_group), 0.0)
        elif c.topk_method != "greedy":
            raise ValueError(f"deepseek_v2 topk_method {c.topk_method!r} is not supported; supported: greedy, group_limited_greedy")
        weight, idx = torch.topk(scores, k=self.top_k, dim=-1, sorted=False)
        return idx, weight * c.routed_scaling_factor

    def shared(self, block, x):
        return block.shared_experts(x)


class DeepseekV3Arch(MoEArch):
    """DeepSeek-V3: sigmoid scores, bias-corrected group-limited top-k, renormalised, scaled; shared experts."""

    name = "deepseek_v3"

    def route(self, block, logits):
        c = self.config
        scores = logits.float().sigmoid()
        choice = scores + block.gate.e_score_correction_bias
        groups = choice.view(-1, c.n_group, scores.shape[-1] // c.n_group).topk(2, dim=-1)[0].sum(dim=-1)
        choice = choice.masked_fill(~group_mask(scores, groups, c.topk_group), float("-inf"))
        idx = torch.topk(choice, k=self.top_k, dim=-1, sorted=False).indices
        weight = scores.gather(1, idx)
        if c.norm_topk_prob:
            weight = weight / (weight.sum(dim=-1, keepdim=True) + 1e-20)
        return idx, weight * c.routed_scaling_factor

    def shared(self, block, x):
        return block.shared_experts(x)


class SlicedArch(MoEArch):
    """moeless-sliced (model/sliced_moe.py): top-k of router logits, weight 1.0, an optional shared expert."""

    name = SLICED_ARCH

    def experts_per_token(self, config):
        return int(getattr(config, CONFIG_SECTION)["top_k"])

    def is_moe_block(self, mlp):
        return isinstance(mlp, SlicedMoE)

    def gate_weight(self, block):
        return block.router.weight

    def expert_ffn(self, block):
        return int(block.gate_proj.shape[1])

    def route(self, block, logits):
        return block.route(logits)

    def shared(self, block, x):
        return block.shared_forward(x)

    def shared_ffn(self, block):
        return block.shared_ffn

    def expert(self, block, e):
        if block.gate_proj.numel() == 0:
            raise ExpertsDroppedError("routed experts were dropped (drop_experts()); run this model with a remote executor")
        return block.expert(e)

    def drop_experts(self, block):
        for name in ("gate_proj", "up_proj", "down_proj"):
            setattr(block, name, nn.Parameter(torch.empty(0), requires_grad=False))


ARCHS: dict[str, type[MoEArch]] = {
    a.name: a
    for a in (SlicedArch, MixtralArch, Qwen2MoeArch, Qwen3MoeArch, OlmoeArch, PhimoeArch, DeepseekV2Arch, DeepseekV3Arch)
}


def arch_name(config) -> str:
    """The moeless arch name of a transformers config (model_type, or moeless-sliced)."""
    section = getattr(config, CONFIG_SECTION, None)
    if isinstance(section, dict) and section.get("arch") == SLICED_ARCH:
        return SLICED_ARCH
    return str(getattr(config, "model_type", ""))


def adapter_for(config) -> MoEArch:
    """The adapter of config's architecture; a clear error naming the supported ones."""
    name = arch_name(config)
    if name not in ARCHS:
        raise ValueError(f"unsupported MoE architecture {name!r}; supported: {', '.join(ARCHS)}")
    return ARCHS[name](config)
