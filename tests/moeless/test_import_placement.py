"""The project's own imports sit at module top, where readers and import-linter see the graph; an
import inside a function is one a comment explains (a heavy module kept off `moeless --help`'s
start-up path, an optional dependency). The comment stands on the line above the function's first
such import, or at the end of that import's line."""

from __future__ import annotations

import ast
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
DIRS = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["package-dir"]


def internal(node: ast.AST) -> bool:
    if isinstance(node, ast.Import):
        return any(alias.name.split(".")[0] == "moeless" for alias in node.names)
    return isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "moeless"


def unexplained(path: Path) -> list[str]:
    """'file:line' of each function whose first internal import has no comment above or beside it."""
    lines = path.read_text().splitlines()
    found = []
    for fn in ast.walk(ast.parse("\n".join(lines))):
        if not isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        imports = sorted((n for n in ast.walk(fn) if internal(n)), key=lambda n: n.lineno)
        if not imports:
            continue
        first = imports[0].lineno
        above, beside = lines[first - 2].strip(), lines[first - 1]
        if not above.startswith("#") and "#" not in beside:
            found.append(f"{path.relative_to(ROOT)}:{first}")
    return found


def test_imports_inside_functions_say_why():
    files = sorted({p for folder in DIRS.values() for p in (ROOT / folder).glob("*.py") if "_pb2" not in p.name})
    found = [where for path in files for where in unexplained(path)]
    assert not found, "imports inside functions without a comment that says why:\n" + "\n".join(found)
