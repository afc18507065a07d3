"""One engine for a base and its ESFT fine-tunes: the non-expert layers batched together, each
token's experts its own model's, one routed call per host and layer for all of them.

An ESFT fine-tune changes only some experts (the router, attention and every other layer are the
base's), so the base's non-expert forward is every fine-tune's too: one engine can batch the
requests of a base and all its ESFT fine-tunes, as ExpertWeave does. Only the experts differ: a
token of fine-tune m must reach m's expert functions. The engine says which member each token of
a forward belongs to (`token_owners`, per thread: each micro-batch its own), and `FamilyExecutor`
shifts that token's expert ids into its member's block: expert e of member m becomes
(j_m + 1) x E + e, j_m the member's place on the hosts (their `--store` order), which the hosts
resolve to m's own expert e of the same layer (expert_fn/stores/model_stores.resolve) and then to
one replica per content key. So a layer is still one routed call per host, whatever the mix of
models in the batch; the placement is the base's, each block placed as the base's experts are
(`_FamilySource`). A host computes each member's tokens of a shared replica as a batch of their
own (they are different experts in the call), so each member's experts compute exactly the rows
its merged model would for those requests, and a token's experts are combined in the reference's
order (the shift keeps a token's experts in ascending order).

Why one engine rather than one per model (serving/embedded.py gives LoRA fine-tunes, whose
attention may differ, engines of their own): N engines each run the non-expert layers for a share
of the rows, N smaller batches at the same total rate; measured in `moeless bench finetunes`
(docs/benchmarks.md). Every host must serve the family's models in the same order (a launcher's or
a StatefulSet's hosts do: one command line).
"""

from __future__ import annotations

import threading
from contextlib import contextmanager
from typing import Iterator, Sequence

import numpy as np
import torch

from moeless.controller.pool.members import NoLiveHostError
from moeless.model.interface import Routing
from moeless.placement.types import LayerPlacement
from moeless.serving.executor import RemoteExecutor
from moeless.serving.placement_source import PlacementSource

_local = threading.local()


@contextmanager
def token_owners(owners: Sequence[int] | None) -> Iterator[None]:
    """While a forward runs in this thread: owners[t] is the member (index) token t belongs to, in the
    order the MoE blocks flatten them ([B, S] row-major); None: every token the first member's."""
    _local.owners = None if owners is None else torch.as_tensor(owners, dtype=torch.long)
    try:
        yield
    finally:
        _local.owners = None


class _FamilySource:
    """The base's placements, each layer's replicas repeated for every member block (block b's expert
    b x E + e where the base's e is: the hosts hold a fine-tune's expert where they hold the base's)."""

    def __init__(self, source: PlacementSource):
        self.source = source
        self.blocks = 1

    @property
    def placement(self):
        return self.source.placement

    @property
    def version(self) -> int:
        return self.source.version

    def layer(self, layer: int) -> tuple[LayerPlacement, int]:
        base, num_hosts = self.source.layer(layer)
        if self.blocks == 1:
            return base, num_hosts
        experts = self.source.placement.num_experts
        return LayerPlacement(np.concatenate([base.expert + b * experts for b in range(self.blocks)]),
                              np.tile(base.gpu, self.blocks), np.tile(base.share, self.blocks)), num_hosts


class FamilyExecutor(RemoteExecutor):
    """A RemoteExecutor (clients bound to the base: members[0]) whose tokens may be any member's."""

    def __init__(self, clients, source: PlacementSource, members: Sequence[str], **options):
        self.family = _FamilySource(source)
        super().__init__(clients, self.family, **options)
        self.members = list(members)  # the names the hosts serve each member by, the base's first
        self._offsets: torch.Tensor | None = None  # member -> what its tokens' expert ids are shifted by

    def run_layer(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x: [T, H] -> [T, H]: each token through its own model's experts (module docstring)."""
        owners = getattr(_local, "owners", None)
        if owners is not None and bool(owners.any()):
            shift = self._member_offsets()[owners]
            routing = Routing(routing.idx + shift[:, None].to(routing.idx.device), routing.weight, routing.logits)
        return super().run_layer(layer, x, routing)

    def _member_offsets(self) -> torch.Tensor:
        """Each member's expert-id shift, (its place among the hosts' models + 1) x E (0 for the base),
        from a host's offer, asked once."""
        if self._offsets is None:
            if self.waker is not None:
                self.waker.wait_for_hosts(lambda: bool(self.pool.clients()), lambda: bool(self.pool.not_ready()))
            clients = list(self.pool.clients().values())
            if not clients:
                raise NoLiveHostError("no expert host in the pool to ask where the fine-tunes' experts are")
            served = [m["name"] for m in clients[0].models()]
            missing = [m for m in self.members if m not in served]
            if missing:
                raise NoLiveHostError(f"the expert hosts serve {served}, not {missing}")
            experts = self.family.placement.num_experts
            self._offsets = torch.tensor([0] + [(served.index(m) + 1) * experts for m in self.members[1:]])
            self.family.blocks = int(self._offsets.max()) // experts + 1
        return self._offsets
