"""Shared fixtures: a tiny sliced MoE model and its routing traces (built once per session)."""

import hashlib

import pytest
import torch

from moeless.model.tiny import tiny_model
from moeless.predictor.collect import collect_traces

PROMPTS = [f"prompt {i}: " + "word " * (i % 7) for i in range(80)]


def fake_tokenize(text: str) -> torch.Tensor:
    """Deterministic token ids for tiny models (they have no tokenizer): [1, 8..31]."""
    seed = int.from_bytes(hashlib.sha256(text.encode()).digest()[:4], "big")
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 128, (1, 8 + seed % 24), generator=generator)


@pytest.fixture(scope="session")
def tokenize():
    return fake_tokenize


@pytest.fixture(scope="session")
def prompts() -> list[str]:
    return PROMPTS


@pytest.fixture(scope="session")
def sliced():
    torch.set_num_threads(1)
    return tiny_model("moeless-sliced", seed=0)


@pytest.fixture(scope="session")
def sliced_traces(sliced):
    return collect_traces(sliced, PROMPTS, tokenize=fake_tokenize, hidden_dtype=torch.float32, progress=False)
