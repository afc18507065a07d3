"""Fixtures shared by every component's tests (keep this small)."""

from __future__ import annotations

import os
import sys

import pytest
from hypothesis import settings

# CI runs property tests on a fixed seed so a submission's result is reproducible; locally
# hypothesis explores new examples on every run.
settings.register_profile("ci", derandomize=True)
if os.environ.get("CI"):
    settings.load_profile("ci")


@pytest.fixture(scope="session", autouse=True)
def _few_torch_threads():
    """One intra-op thread: tests run tiny tensors, where a thread pool on 2 busy cores only
    spins (the model tests took 6x longer, in CPU time, with 2 threads)."""
    try:
        import torch
    except ImportError:
        return
    torch.set_num_threads(1)


@pytest.fixture
def tiny():
    """A factory of tiny random MoE models: tiny("mixtral", seed=0) -> MoEModel (fresh each call)."""
    from moeless.model.tiny import tiny_model

    return tiny_model


_session = {}


def pytest_sessionfinish(session, exitstatus):
    _session["status"] = int(exitstatus)


@pytest.hookimpl(trylast=True)
def pytest_unconfigure(config):
    """End the process with pytest's own status once everything is reported and torn down.

    Why: the whole suite's process (not any subset we ran) aborted in native finalizers at
    interpreter exit after every test had passed and been reported (SIGABRT, no Python frame;
    Ray, gRPC, torch and numba loaded). Fixtures, Ray and the hosts are closed by then; what
    os._exit skips is only the interpreter's own teardown."""
    if "status" in _session:
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(_session["status"])
