"""One engine for a base and its ESFT fine-tunes: the non-expert layers batched together, each
token's experts its own model's.

An ESFT fine-tune changes only some experts (the router, attention and every other layer are the
base's), so the base's non-expert forward is every fine-tune's too: one engine can batch the
requests of a base and all its ESFT fine-tunes, as ExpertWeave does. Only the expert calls differ:
a token of fine-tune m goes to m's expert functions. `FamilyExecutor` holds one RemoteExecutor per
member (model-bound clients: the hosts map each model's experts to one replica per content key,
expert_fn/stores/model_stores.py) and, per layer, runs each member's tokens through its own
executor, every member's calls in flight together: each member's expert calls carry exactly the rows the merged model would compute for
those requests, so a fine-tune's answer is its merged model's. The engine says which member each
token of a forward belongs to (`token_owners`, per thread: each micro-batch its own).

Why one engine rather than one per model (serving/embedded.py runs LoRA fine-tunes, whose
attention may differ, in engines of their own): N engines each run the non-expert layers for a
share of the rows, N smaller batches at the same total rate; measured in `moeless bench
finetunes` (docs/benchmarks.md).
"""

from __future__ import annotations

import threading
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import fields
from typing import Iterator, Sequence

import torch

from moeless.model.interface import Routing
from moeless.serving.executor import LayerCall, LayerTimes, RemoteExecutor

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


class FamilyExecutor:
    """An ExpertExecutor over members' RemoteExecutors (members[0]: the base); what the live loop
    and the app read of an executor (times, dead hosts, relevel, last call) spans them all."""

    def __init__(self, members: Sequence[RemoteExecutor]):
        if not members:
            raise ValueError("a family needs at least its base's executor")
        self.members = list(members)
        self._calls = threading.local()
        threads = torch.get_num_threads()  # OpenMP's count is per thread: the workers compute as the caller does
        self._pool = ThreadPoolExecutor(max(len(self.members) - 1, 1), thread_name_prefix="family",
                                        initializer=torch.set_num_threads, initargs=(threads,))

    def run_layer(self, layer: int, x: torch.Tensor, routing: Routing) -> torch.Tensor:
        """x: [T, H] -> [T, H]: each member's tokens through that member's executor."""
        owners = getattr(_local, "owners", None)
        present = [0] if owners is None else torch.unique(owners).tolist()
        if len(present) == 1:
            out = self.members[present[0]].run_layer(layer, x, routing)
            self.last_call = self.members[present[0]].last_call
            return out
        rows = {m: (owners == m).nonzero(as_tuple=True)[0] for m in present}

        def run(m: int) -> tuple[torch.Tensor, LayerCall | None]:
            part = Routing(routing.idx[rows[m]], routing.weight[rows[m]], routing.logits[rows[m]])
            return self.members[m].run_layer(layer, x[rows[m]], part), self.members[m].last_call

        # Every member's calls in flight at once: one waits on the hosts while the next is packed.
        later = {m: self._pool.submit(run, m) for m in present[1:]}
        done = {present[0]: run(present[0])} | {m: future.result() for m, future in later.items()}
        out = torch.empty_like(x)
        for m, (part, _) in done.items():
            out[rows[m]] = part
        # the live loop's figures: the member call with the most tokens
        self.last_call = done[max(present, key=lambda m: rows[m].numel())][1]
        return out

    @property
    def last_call(self) -> LayerCall | None:
        return getattr(self._calls, "last", None)

    @last_call.setter
    def last_call(self, call: LayerCall | None) -> None:
        self._calls.last = call

    @property
    def relevel(self):
        return self.members[0].relevel

    @relevel.setter
    def relevel(self, relevel) -> None:
        for member in self.members:
            member.relevel = relevel

    @property
    def times(self) -> LayerTimes:
        """Every member's figures added up."""
        return LayerTimes(**{f.name: sum(getattr(m.times, f.name) for m in self.members) for f in fields(LayerTimes)})

    @property
    def dead_hosts(self) -> set[int]:
        return set().union(*(m.dead_hosts for m in self.members))

    @property
    def clients(self):
        return self.members[0].clients

    def close(self) -> None:
        self._pool.shutdown(wait=True)
        for member in self.members:
            member.close()
