"""Helpers of the expert_fn tests (a uniquely named module: every test folder has a conftest)."""

from __future__ import annotations

import time
from pathlib import Path

import torch

from moeless.expert_fn.errors import ExpertHostUnavailable
from moeless.model.weight_store import WeightStore, export_experts

LAYERS, EXPERTS, HIDDEN, FFN = 2, 4, 16, 8
CORRUPT = (1, 3)  # the expert whose file the `store` fixture damages


class FakeClock:
    """A clock that moves only when told: clock() -> now; clock.advance(s)."""

    def __init__(self, start: float = 100.0) -> None:
        self.now = start

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def random_store(root: Path, layers: int, experts: int, hidden: int, ffn: int, seed: int = 0,
                 dtype: torch.dtype = torch.float32) -> WeightStore:
    gen = torch.Generator().manual_seed(seed)

    def weights() -> dict[str, torch.Tensor]:
        return {
            "gate": (torch.randn(ffn, hidden, generator=gen) / hidden**0.5).to(dtype),
            "up": (torch.randn(ffn, hidden, generator=gen) / hidden**0.5).to(dtype),
            "down": (torch.randn(hidden, ffn, generator=gen) / ffn**0.5).to(dtype),
        }

    triples = ((layer, expert, weights()) for layer in range(layers) for expert in range(experts))
    return export_experts(triples, root, model="random", num_layers=layers, num_experts=experts, act="silu")


def corrupt(store: WeightStore, layer: int, expert: int) -> Path:
    """Flip bytes in the middle of one expert's file; returns its path."""
    path = store.root / store.index["experts"][f"{layer}/{expert}"]["file"]
    data = bytearray(path.read_bytes())
    data[len(data) // 2 : len(data) // 2 + 8] = b"\xff" * 8
    path.write_bytes(bytes(data))
    return path


def answer_after_restart(client, call, x: torch.Tensor, timeout_s: float = 10.0) -> torch.Tensor:
    """z of `call` from a host that is restarting: retried while it is unavailable, for up to timeout_s."""
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            return client.submit(call, x).result().z
        except ExpertHostUnavailable:
            assert time.monotonic() < deadline, "restarted host not reachable"
            time.sleep(0.05)
