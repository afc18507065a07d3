"""Every module that a docstring, comment or document names exists: `serving/app.py`,
`controller/planning/actor.py`, `moeless.twin.compare`, `twin/forecasts.iteration_forecasts`; and
every file named bare, without its folder (`window.py`, `design.md`), is a file of the checkout.

Files move; the words that point at them must move with them (four docstrings once named modules
that no longer existed; later, bare names outlived their files: the planning loop's first modules,
the placement board's, and the design document's name in capitals after it moved to docs/).
"""

from __future__ import annotations

import ast
import importlib.util
import io
import os
import re
import tokenize
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
TOPS = sorted({folder.split("/")[0] for folder in DIRS.values()})
# A file path (a package's folder, subfolders, a module's file), or a module and what it holds
# (folder/module.attribute, folder/module alone): prose such as "predictor/scaler/placer" is neither.
PATH = re.compile(r"(?<![\w/.-])((?:%s)(?:/\w+)+(?=\.py\b)|(?:%s)/\w+(?=\.\w|\b(?!/)))" % ("|".join(TOPS), "|".join(TOPS)))
# A dotted module name under one of moeless's packages (not the API group moeless.io and the like).
PACKAGES = sorted({name.split(".")[1] for name in DIRS if "." in name} | {"cli"})
DOTTED = re.compile(r"(?<![\w.])(moeless\.(?:%s)(?:\.\w+)*)" % "|".join(PACKAGES))
# A file name with a suffix of the checkout's own sources and documents, bare or after its folders
# (docs/design.md is read as design.md), matched against the checkout's file names, case and all.
# Data files (.json, .npy, .jsonl) are named as what a command reads or writes, not as files here.
BARE = re.compile(r"(?<![\w.-])([\w-]+(?:\.[\w-]+)*\.(?:py|md|sh|yaml|yml|proto|toml))\b")
# The few names of files that are not in the checkout by design, and where they are.
ELSEWHERE = {
    "ENVIRONMENT.md": "the machines' notes, in ../shared beside the checkout",
    "config.yaml": "the serving knobs' key in a policy's ConfigMap: a file in the serving pod",
    "FILE.yaml": "a command line's placeholder (--config FILE.yaml)",
}
SKIPPED = {"__pycache__", "build", "dist", "out"}  # and hidden folders (.git, .venv) and *.egg-info


def texts() -> list[Path]:
    files = [path for folder in DIRS.values() for path in (ROOT / folder).glob("*.py") if "_pb2" not in path.name]
    return sorted({*files, ROOT / "README.md", *(ROOT / "docs").rglob("*.md"), *(ROOT / "scripts").glob("*.py"),
                   *(ROOT / "tests").rglob("*.py")})


def prose(file: Path) -> list[tuple[int, str]]:
    """(line number, text) of a document's lines, or of a module's comments and docstrings (its code's
    strings name files it writes, such as a test's temporary files)."""
    text = file.read_text()
    if file.suffix == ".md":
        return list(enumerate(text.splitlines(), start=1))
    found = [(t.start[0], t.string) for t in tokenize.generate_tokens(io.StringIO(text).readline)
             if t.type == tokenize.COMMENT]
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
                found += [(first.lineno + i, line) for i, line in enumerate(first.value.value.splitlines())]
    return found


def checkout_names() -> set[str]:
    """The name of every file and folder in the checkout (not in hidden or build folders)."""
    names = set()
    for folder, dirs, files in os.walk(ROOT):
        dirs[:] = [d for d in dirs if not d.startswith(".") and d not in SKIPPED and not d.endswith(".egg-info")]
        names.update(files, dirs)
    return names


def path_exists(ref: str) -> bool:
    path = ROOT / ref
    return path.with_suffix(".py").is_file() or path.is_dir() or path.is_file()


def module_exists(name: str) -> bool:
    """name is a module, or an attribute path under one (moeless.twin.twin.replay); under a package
    the next part must be one of its modules or a name its __init__ defines."""
    parts = name.split(".")
    for cut in range(len(parts), 1, -1):
        try:
            spec = importlib.util.find_spec(".".join(parts[:cut]))
        except ModuleNotFoundError:
            continue
        if spec is None:
            continue
        if cut == len(parts) or spec.submodule_search_locations is None:
            return True
        return re.search(rf"\b{parts[cut]}\b", Path(spec.origin).read_text()) is not None  # a name its __init__ defines
    return False


def test_every_named_module_exists():
    missing = []
    for file in texts():
        for number, line in enumerate(file.read_text().splitlines(), start=1):
            where = f"{file.relative_to(ROOT)}:{number}"
            missing += [f"{where}: {m}" for m in PATH.findall(line) if not path_exists(m)]
            missing += [f"{where}: {m}" for m in DOTTED.findall(line) if not module_exists(m.rstrip("."))]
    assert not missing, "names of modules that do not exist:\n" + "\n".join(missing)


def test_every_file_named_bare_is_in_the_checkout():
    here = checkout_names() | set(ELSEWHERE)
    missing = [f"{file.relative_to(ROOT)}:{number}: {name}" for file in texts() for number, line in prose(file)
               for name in BARE.findall(line) if name not in here]
    assert not missing, "names of files that are not in the checkout:\n" + "\n".join(missing)
