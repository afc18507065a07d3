"""Every image carries every package: the images' source lists come from pyproject.toml's package-dir.

An image built from 7 of 9 source folders once failed `moeless expert-host --help` (the CLI's parser
imports every command's package); the lists now come from one place, and this checks each image.
"""

from __future__ import annotations

import fnmatch
import inspect
import sys
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "scripts"))
sys.path.insert(0, str(ROOT / "tests" / "k8s"))

import k8s_helm_release  # noqa: E402
import k8s_node_e2e  # noqa: E402

PACKAGE_DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def carried(folder: str, sources: tuple[str, ...]) -> bool:
    return any(folder == s or folder.startswith(s + "/") for s in sources)


def test_the_e2e_images_carry_every_package():
    sources = k8s_node_e2e.image_sources()
    assert {"pyproject.toml", "README.md"} <= set(sources)
    for package, folder in PACKAGE_DIRS.items():
        assert carried(folder, sources), f"{package} ({folder}/) is not in the e2e images' sources {sources}"
    # The helm tier builds its image from the same list, not one of its own.
    assert k8s_helm_release.image_sources is k8s_node_e2e.image_sources
    assert "image_sources()" in inspect.getsource(k8s_helm_release.build_images)


def test_the_dockerfile_copies_every_package():
    copies = [line.split()[1:] for line in (ROOT / "Dockerfile").read_text().splitlines() if line.startswith("COPY ")]
    sources = tuple(src.rstrip("/") for args in copies for src in args[:-1])
    ignored = [p.strip().rstrip("/") for p in (ROOT / ".dockerignore").read_text().splitlines() if p.strip()]
    for package, folder in PACKAGE_DIRS.items():
        assert "." in sources or carried(folder, sources), f"the Dockerfile copies no {folder}/ ({package})"
        top = folder.split("/")[0]
        assert not any(fnmatch.fnmatch(top, pattern) for pattern in ignored), f".dockerignore leaves out {top}/"
    assert not any(fnmatch.fnmatch("pyproject.toml", p) or fnmatch.fnmatch("README.md", p) for p in ignored)
