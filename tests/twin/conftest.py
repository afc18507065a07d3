"""The shipped routing logs (traces/logs/), imported once per session into a cache of the tests' own."""

from __future__ import annotations

import pytest

from moeless.traces.routing_file import Routing, load_routing
from moeless.traces.shipped import SHIPPED, routing_path


@pytest.fixture(scope="session")
def shipped(tmp_path_factory) -> dict[str, Routing]:
    """name -> Routing of every shipped log, imported by name as `--routing NAME` does (about 1.5 s)."""
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("MOELESS_CACHE", str(tmp_path_factory.mktemp("cache")))
        return {name: load_routing(routing_path(name)) for name in SHIPPED}
