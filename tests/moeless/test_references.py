"""Every module that a docstring, comment or document names exists: `serving/app.py`,
`controller/planning/actor.py`, `moeless.twin.compare`, `twin/forecasts.iteration_forecasts`.

Files move; the words that point at them must move with them (four docstrings once named modules
that no longer existed).
"""

from __future__ import annotations

import importlib.util
import re
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]
TOPS = sorted({folder.split("/")[0] for folder in DIRS.values()})
# A file path (folder/.../module.py), or a module and what it holds (folder/module.attribute,
# folder/module alone): prose such as "predictor/scaler/placer" is neither.
PATH = re.compile(r"(?<![\w/.-])((?:%s)(?:/\w+)+(?=\.py\b)|(?:%s)/\w+(?=\.\w|\b(?!/)))" % ("|".join(TOPS), "|".join(TOPS)))
# A dotted module name under one of moeless's packages (not the API group moeless.io and the like).
PACKAGES = sorted({name.split(".")[1] for name in DIRS if "." in name} | {"cli"})
DOTTED = re.compile(r"(?<![\w.])(moeless\.(?:%s)(?:\.\w+)*)" % "|".join(PACKAGES))


def texts() -> list[Path]:
    files = [path for folder in DIRS.values() for path in (ROOT / folder).glob("*.py") if "_pb2" not in path.name]
    return sorted({*files, ROOT / "README.md", *(ROOT / "docs").glob("*.md"), *(ROOT / "scripts").glob("*.py"),
                   *(ROOT / "tests").rglob("*.py")})


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
