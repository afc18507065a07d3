"""Fixtures of the Kubernetes tests: one real loopback control plane per test session, kubectl and helm."""

from __future__ import annotations

from pathlib import Path

import pytest

from k8s_support import ControlPlane, Kubectl, helm_binary


@pytest.fixture(scope="session")
def cluster(tmp_path_factory) -> ControlPlane:
    plane = ControlPlane(tmp_path_factory.mktemp("k8s")).start()
    try:
        yield plane
    finally:
        plane.stop()


@pytest.fixture(scope="session")
def kubectl(cluster) -> Kubectl:
    return Kubectl(cluster.kubeconfig)


@pytest.fixture(scope="session")
def helm() -> Path:
    return helm_binary()
