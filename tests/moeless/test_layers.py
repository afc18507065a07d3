"""The layers of pyproject.toml's import contracts hold, checked by import-linter over the installed
`moeless.*` names, and a deliberate violation breaks them: the layers, and each forbidden contract
(the pure policies, the data path) on every kind of import it forbids, direct or through another
module.

import-linter walks the root package's folder, but moeless's subpackages live in other folders
(pyproject's package-dir), so each check builds a tree `moeless/` of links to them first and runs
`lint-imports` from outside the checkout (from inside it, the checkout's own `moeless/` folder
would shadow the tree).
"""

from __future__ import annotations

import os
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PYPROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())
LINT_IMPORTS = Path(sys.executable).parent / "lint-imports"


def package_tree(dest: Path) -> Path:
    """dest/moeless: links to every folder of [tool.setuptools.package-dir], nested as the names are
    (plant() puts a violation in)."""
    dirs = PYPROJECT["tool"]["setuptools"]["package-dir"]
    top = dest / "moeless"
    top.mkdir(parents=True)
    for entry in (ROOT / dirs["moeless"]).iterdir():
        if entry.name != "__pycache__":
            (top / entry.name).symlink_to(entry)
    for name, folder in sorted(dirs.items()):
        parts = name.split(".")[1:]
        if len(parts) != 1 or (top / parts[0]).exists():
            continue  # nested packages come with their parent's folder; moeless/core etc. with moeless/
        (top / parts[0]).symlink_to(ROOT / folder)
    return dest


def plant(tree: Path, module: str, source: str) -> None:
    """Add `source` at the end of `module`'s file in a package_tree (a new file where there is none);
    each linked folder on its way becomes a real folder of links, so the checkout is not touched."""
    *packages, name = module.split(".")
    folder = tree
    for part in packages:
        folder = folder / part
        if folder.is_symlink():
            real = folder.resolve()
            folder.unlink()
            folder.mkdir()
            for entry in real.iterdir():
                if entry.name != "__pycache__":
                    (folder / entry.name).symlink_to(entry)
    file = folder / f"{name}.py"
    before = file.read_text() + "\n" if file.exists() else ""
    file.unlink(missing_ok=True)
    file.write_text(before + source)


def lint_imports(tree: Path) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    return subprocess.run([str(LINT_IMPORTS), "--no-cache", str(ROOT / "pyproject.toml")], cwd=tree, env=env,
                          capture_output=True, text=True, timeout=300)


def test_every_package_is_in_a_layer():
    layers = next(c for c in PYPROJECT["tool"]["importlinter"]["contracts"] if c["id"] == "layers")["layers"]
    layered = {name.strip() for layer in layers for name in layer.split("|")}
    for package in PYPROJECT["tool"]["setuptools"]["packages"]:
        if package == "moeless":
            continue
        assert any(package == name or package.startswith(name + ".") for name in layered), \
            f"{package} is in no layer of pyproject's import contracts"


def test_the_import_contracts_hold(tmp_path: Path):
    result = lint_imports(package_tree(tmp_path))
    assert result.returncode == 0, result.stdout + result.stderr
    contracts = len(PYPROJECT["tool"]["importlinter"]["contracts"])
    assert f"Contracts: {contracts} kept, 0 broken." in result.stdout


@pytest.mark.parametrize("package, broken", [
    # A pure policy that reaches up into serving: against the layers.
    ("moeless.placement", "moeless.placement is not allowed to import moeless.serving"),
    # Serving and the twin sit side by side: neither imports the other.
    ("moeless.twin", "moeless.twin is not allowed to import moeless.serving"),
])
def test_a_violation_breaks_the_layers(tmp_path: Path, package: str, broken: str):
    tree = package_tree(tmp_path)
    plant(tree, f"{package}.violation", "from moeless.serving import scatter\n")
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    assert broken in result.stdout and f"{package}.violation -> moeless.serving.scatter" in result.stdout


@pytest.mark.parametrize("module, planted, broken", [
    # The pure contract: its first rule, and the operator's pool reconcile back on the follower file
    # (pod_member's old home), which reaches the Kubernetes client through it.
    ("moeless.controller.planning.rules", "import ray\n", "moeless.controller.planning.rules is not allowed to import ray"),
    ("moeless.controller.operator.pool_reconcile", "from moeless.controller.pool import sources\n",
     "moeless.controller.operator.pool_reconcile is not allowed to import kubernetes"),
    # ... and what it forbids since: a socket, a process, a thread.
    ("moeless.controller.operator.scaling", "import socket\n", "moeless.controller.operator.scaling is not allowed to import socket"),
    ("moeless.twin.twin", "import subprocess\n", "moeless.twin.twin is not allowed to import subprocess"),
    ("moeless.controller.pool.members", "import threading\n", "moeless.controller.pool.members is not allowed to import threading"),
    # The data path: a layer call that takes the policy on the API server as its wake target itself,
    # a scatter that speaks HTTP, an expert-host client that calls Ray.
    ("moeless.serving.executor", "from moeless.controller.pool.kube import KubePolicy\n",
     "moeless.serving.executor is not allowed to import kubernetes"),
    ("moeless.serving.scatter", "import urllib3\n", "moeless.serving.scatter is not allowed to import urllib3"),
    ("moeless.expert_fn.client.client", "import ray\n", "moeless.expert_fn is not allowed to import ray"),
])
def test_a_violation_breaks_a_forbidden_contract(tmp_path: Path, module: str, planted: str, broken: str):
    tree = package_tree(tmp_path)
    plant(tree, module, planted)
    result = lint_imports(tree)
    assert result.returncode != 0, result.stdout
    assert broken in result.stdout and f"{module} -> " in result.stdout, result.stdout
