"""Fixtures of the expert_fn tests: a random-weight store (tiny shapes) and a fake clock."""

from __future__ import annotations

import pytest

from moeless.model.weight_store import WeightStore

from expert_fn_support import CORRUPT, EXPERTS, FFN, HIDDEN, LAYERS, FakeClock, corrupt, random_store


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(scope="session")
def store(tmp_path_factory) -> WeightStore:
    """A 2-layer, 4-expert store (H=16, F=8) whose expert CORRUPT has a damaged file."""
    store = random_store(tmp_path_factory.mktemp("store"), LAYERS, EXPERTS, HIDDEN, FFN)
    corrupt(store, *CORRUPT)
    return store
