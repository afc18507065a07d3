"""MoEModel: the contract of model/interface.py over any supported architecture.

A MoEModel holds a transformers causal LM (`hf`, float32, eval mode) untouched. While one of its
own forward calls runs, every MoE block is swapped for a dispatching block that computes the
routing in-process, hands the routed experts to an ExpertExecutor, and adds the shared experts;
`hf`'s own forward stays the transformers reference.
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import nn

from moeless.model.adapters import Expert, adapter_for
from moeless.model.experts import expert_forward
from moeless.model.interface import ExpertExecutor, LayerRecord, MoESpec, Routing, RoutingCapture


class LocalExecutor:
    """Runs routed experts in-process from a weight source (the reference executor).

    expert_weights(layer, expert) -> {"gate", "up", "down"}: the model's own weights by default,
    or e.g. WeightStore.load to run from an exported store.
    """

    def __init__(self, expert_weights: Callable[[int, int], Expert], act: str):
        self.expert_weights = expert_weights
        self.act = act

    def expert_output(self, layer: int, expert: int, x: torch.Tensor) -> torch.Tensor:
        """Expert (layer, expert) on its tokens x: [T, H] -> [T, H] (a LoRA executor overrides it)."""
        return expert_forward(self.expert_weights(layer, expert), x, self.act)

    def run_layer(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x: [T, H] -> [T, H]: per token, the routing-weighted sum of its chosen experts' outputs."""
        out = torch.zeros_like(x)
        for e in torch.unique(routing.idx).tolist():
            token, slot = (routing.idx == e).nonzero(as_tuple=True)
            y = self.expert_output(layer, e, x[token])
            # index_put_ with accumulate: the same sums as index_add_, which is ~1000x slower on one CPU row
            out.index_put_((token,), y * routing.weight[token, slot, None].to(y.dtype), accumulate=True)
        return out


class _DispatchBlock(nn.Module):
    """Stands in for MoE layer `layer`'s block during a MoEModel forward call."""

    def __init__(self, model: "MoEModel", layer: int):
        super().__init__()
        self.layer = layer
        object.__setattr__(self, "model", model)  # a back-reference, not a submodule

    def forward(self, hidden_states: torch.Tensor) -> torch.Tensor:
        """hidden_states: [B, S, H] -> [B, S, H]."""
        m, l, call = self.model, self.layer, self.model._local.forward
        x = hidden_states.reshape(-1, hidden_states.shape[-1])
        routing = m.route(l, x)
        out = call.executor.run_layer(l, x, routing)
        shared = m.shared_forward(l, x)
        if shared is not None:
            out = out + shared
        if call.capture is not None:
            m._record(l, x, routing, call)
        return out.reshape(hidden_states.shape)


@dataclass
class _Forward:
    """A forward call in progress, in its thread: its executor, the tokens under the attention
    mask ([B*S] bool, None: all), the capture recording it."""

    executor: ExpertExecutor
    token_mask: torch.Tensor | None
    capture: RoutingCapture | None


class MoEModel:
    """A transformers MoE causal LM seen through moeless' contract (model/interface.py).

    Layer indices l are MoE-layer indices 0..L-1; spec.moe_layer_ids maps them to decoder layers.
    """

    def __init__(self, hf: nn.Module, tokenizer=None):
        self.hf = hf.float().eval()
        self._embedding = hf.get_input_embeddings()
        self.tokenizer = tokenizer
        self.arch = adapter_for(hf.config)
        decoder = hf.model.layers
        self._layer_ids = tuple(i for i, layer in enumerate(decoder) if self.arch.is_moe_block(layer.mlp))
        if not self._layer_ids:
            raise ValueError(f"{type(hf).__name__} has no MoE blocks of arch {self.arch.name!r}")
        self._blocks = [decoder[i].mlp for i in self._layer_ids]
        first, config = self._blocks[0], hf.config
        self.spec = MoESpec(
            arch=self.arch.name,
            num_layers=len(self._blocks),
            num_experts=self.arch.num_experts(first),
            top_k=self.arch.top_k,
            hidden_size=int(config.hidden_size),
            expert_ffn=self.arch.expert_ffn(first),
            act=self.arch.act,
            vocab_size=int(config.vocab_size),
            max_positions=int(config.max_position_embeddings),
            moe_layer_ids=self._layer_ids,
            shared_ffn=self.arch.shared_ffn(first),
        )
        self._gates = [self._make_gate(b) for b in self._blocks]
        self._dispatch = [_DispatchBlock(self, l) for l in range(len(self._blocks))]
        self._captures: dict[int, RoutingCapture] = {}  # by thread: a capture records its own thread's forwards
        self._local = threading.local()  # .forward: this thread's _Forward in progress
        self._lock = threading.Lock()  # guards the swap of modules in and out of hf
        self._active = 0  # forwards in progress (micro-batches run theirs in threads of their own)

    # ---- the gate and routing ----------------------------------------------------------

    def _make_gate(self, block: nn.Module) -> nn.Linear:
        weight = self.arch.gate_weight(block)
        gate = nn.Linear(weight.shape[1], weight.shape[0], bias=False)
        gate.weight = weight  # shares the model's parameter
        return gate

    def gate(self, l: int) -> nn.Module:
        """Layer l's gate: a module mapping gate input [T, H] to logits [T, E] (deep-copy to clone)."""
        return self._gates[l]

    def routing_from_logits(self, l: int, logits: torch.Tensor) -> Routing:
        """Layer l's routing rule applied to logits: [T, E]."""
        idx, weight = self.arch.route(self._blocks[l], logits)
        return Routing(idx=idx, weight=weight, logits=logits)

    def route(self, l: int, x: torch.Tensor) -> Routing:
        """Layer l's routing of gate input x: [T, H]."""
        return self.routing_from_logits(l, self._gates[l](x))

    # ---- experts ----------------------------------------------------------------------

    def expert_weights(self, l: int, e: int) -> Expert:
        """Expert (l, e): {"gate": [F, H], "up": [F, H], "down": [H, F]} (views, do not modify)."""
        if not 0 <= e < self.spec.num_experts:
            raise IndexError(f"expert {e} out of range 0..{self.spec.num_experts - 1}")
        return self.arch.expert(self._blocks[l], e)

    def iter_experts(self) -> Iterator[tuple[int, int, Expert]]:
        """(l, e, weights) for every routed expert, layer-major (feed to weight_store.export_experts)."""
        for l in range(self.spec.num_layers):
            for e in range(self.spec.num_experts):
                yield l, e, self.expert_weights(l, e)

    def shared_forward(self, l: int, x: torch.Tensor) -> torch.Tensor | None:
        """Layer l's shared experts on x: [T, H] -> [T, H], or None when the arch has none."""
        return self.arch.shared(self._blocks[l], x)

    def local_executor(self) -> LocalExecutor:
        """The in-process reference executor over this model's own expert weights."""
        return LocalExecutor(self.expert_weights, self.spec.act)

    @property
    def device(self) -> torch.device:
        """Where the model's weights are (the non-expert layers', once the experts are dropped)."""
        return self._embedding.weight.device  # one attribute: every forward asks (the parameters' walk costs ~9 us)

    def to(self, device: str | torch.device) -> "MoEModel":
        """Move the model to `device` (e.g. "cuda:0"); forward then takes its inputs there. Drop
        the experts first where only the non-expert layers should take the device's memory."""
        self.hf.to(device)
        return self

    def drop_experts(self) -> None:
        """Free the routed experts' weights; forward then needs a remote executor."""
        for block in self._blocks:
            self.arch.drop_experts(block)

    # ---- forward, generation, capture ---------------------------------------------------

    @torch.no_grad()
    def forward(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor | None = None,
        past_key_values=None,
        use_cache: bool = False,
        executor: ExpertExecutor | None = None,
        position_ids: torch.Tensor | None = None,
    ):
        """One iteration. input_ids: [B, S]; attention_mask: [B, past + S] -> the HF output
        (.logits [B, S, V], .past_key_values) on the model's device, where the inputs are moved."""
        device = self.device
        input_ids = input_ids.to(device)
        attention_mask = None if attention_mask is None else attention_mask.to(device)
        position_ids = None if position_ids is None else position_ids.to(device)
        mask = None if attention_mask is None else attention_mask[:, -input_ids.shape[1]:].reshape(-1).bool()
        call = _Forward(executor or self.local_executor(), mask, self._captures.get(threading.get_ident()))
        if call.capture is not None:
            call.capture.iterations.append([])
        self._local.forward = call
        self._swap(+1)
        try:
            return self.hf(
                input_ids=input_ids,
                attention_mask=attention_mask,
                position_ids=position_ids,
                past_key_values=past_key_values,
                use_cache=use_cache,
            )
        finally:
            self._local.forward = None
            self._swap(-1)

    def _swap(self, change: int) -> None:
        """The dispatch blocks stand in for the MoE blocks while any forward runs (the first swaps
        them in, the last back out: between forwards hf is the model as loaded)."""
        with self._lock:
            before, self._active = self._active, self._active + change
            if (before, self._active) in ((0, 1), (1, 0)):
                decoder = self.hf.model.layers
                for i, dispatch, block in zip(self._layer_ids, self._dispatch, self._blocks):
                    decoder[i].mlp = dispatch if self._active else block

    @torch.no_grad()
    def generate(
        self,
        ids: torch.Tensor,
        max_new_tokens: int,
        executor: ExpertExecutor | None = None,
        attention_mask: torch.Tensor | None = None,
        eos_token_id: int | None = None,
    ) -> torch.Tensor:
        """Greedy decoding with a KV cache. ids: [B, S] (left-padded when attention_mask is given)
        -> [B, S + N] on the model's device, N <= max_new_tokens. Each step is one forward call
        (one capture iteration).

        With eos_token_id, stops once every sequence has produced it (tokens a sequence
        generates after its own EOS are greedy continuations, not padding).
        """
        ids = ids.to(self.device)
        mask = torch.ones_like(ids) if attention_mask is None else attention_mask.to(ids.device)
        out, step_ids, cache = ids, ids, None
        finished = torch.zeros(ids.shape[0], dtype=torch.bool, device=ids.device)
        for _ in range(max_new_tokens):
            positions = (mask.cumsum(-1) - 1).clamp(min=0)[:, -step_ids.shape[1]:]
            res = self.forward(step_ids, mask, cache, use_cache=True, executor=executor, position_ids=positions)
            step_ids = res.logits[:, -1].argmax(-1, keepdim=True)
            cache = res.past_key_values
            out = torch.cat([out, step_ids], dim=1)
            mask = torch.cat([mask, torch.ones_like(step_ids)], dim=1)
            if eos_token_id is not None:
                finished |= step_ids[:, 0] == eos_token_id
                if bool(finished.all()):
                    break
        return out

    @contextmanager
    def capture(self) -> Iterator[RoutingCapture]:
        """Record routing of every forward call this thread makes inside the block (tokens under
        the attention mask); forwards from other threads meanwhile are not recorded."""
        thread = threading.get_ident()
        if thread in self._captures:
            raise RuntimeError("a capture is already open in this thread; close it before opening another")
        capture = RoutingCapture()
        self._captures[thread] = capture
        try:
            yield capture
        finally:
            del self._captures[thread]

    def _record(self, l: int, x: torch.Tensor, routing: Routing, call: _Forward) -> None:
        keep = call.token_mask
        gate_input, idx = (x, routing.idx) if keep is None else (x[keep], routing.idx[keep])
        load = torch.bincount(idx.reshape(-1), minlength=self.spec.num_experts)
        call.capture.iterations[-1].append(LayerRecord(gate_input=gate_input.clone(), idx=idx.clone(), load=load))
