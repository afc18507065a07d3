"""No import circles between moeless's modules, inside a package or across packages, and a planted
circle fails.

The layer contracts (test_layers.py) order packages but not the modules inside one: serving's app
imported its config, which imported `moeless serve`'s command line for a tuple, which imports the
embedded system, which imports the app. A circle makes a module half-initialised for whoever
imports it first, and no module of one can be read or tested without the others.

The graph is grimp's (import-linter's) over the same link tree test_layers.py builds, run in a
subprocess from outside the checkout for the same reason. It holds every import, the ones inside
functions too (a command imports its heavy modules when it runs; that import is a dependency all
the same, and it closed serving's circle) and the ones under TYPE_CHECKING (a circle of names is
still one a reader has to untangle).
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from test_layers import package_tree, plant

# Prints each circle as "a -> b (l.N) -> ... -> a", one a line: for every group of modules that
# reach each other (a strongly connected component), the shortest way around from its first module.
CYCLES = '''
import grimp

graph = grimp.build_graph("moeless", cache_dir=None)
index, low, stack, on_stack, groups = {}, {}, [], set(), []


def visit(first):  # Tarjan's strongly connected components, without recursion
    work = [(first, iter(sorted(graph.find_modules_directly_imported_by(first))))]
    index[first] = low[first] = len(index)
    stack.append(first)
    on_stack.add(first)
    while work:
        module, imported = work[-1]
        for other in imported:
            if other not in index:
                index[other] = low[other] = len(index)
                stack.append(other)
                on_stack.add(other)
                work.append((other, iter(sorted(graph.find_modules_directly_imported_by(other)))))
                break
            if other in on_stack:
                low[module] = min(low[module], index[other])
        else:
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[module])
            if low[module] == index[module]:
                group = []
                while not group or group[-1] != module:
                    group.append(stack.pop())
                    on_stack.discard(group[-1])
                if len(group) > 1:
                    groups.append(sorted(group))


for module in sorted(graph.modules):
    if module not in index:
        visit(module)
for group in sorted(groups):
    start = group[0]
    back = min((graph.find_shortest_chain(nxt, start) for nxt in graph.find_modules_directly_imported_by(start)
                if nxt in group), key=len)
    ring = (start, *back)
    lines = [min(d["line_number"] for d in graph.get_import_details(importer=a, imported=b)) for a, b in zip(ring, ring[1:])]
    print(start + "".join(f" -> {b} (l.{n})" for b, n in zip(ring[1:], lines)))
'''


def cycles(tree: Path) -> list[str]:
    """Every import circle among the tree's moeless modules, one line each (empty: none)."""
    env = {**os.environ, "PYTHONPATH": str(tree)}
    run = subprocess.run([sys.executable, "-c", CYCLES], cwd=tree, env=env, capture_output=True, text=True, timeout=300)
    assert run.returncode == 0, run.stderr
    return run.stdout.splitlines()


def test_no_module_imports_itself_round_a_circle(tmp_path: Path):
    found = cycles(package_tree(tmp_path))
    assert not found, "import circles (break each by moving what both ends need below them):\n" + "\n".join(found)


@pytest.mark.parametrize("package, first, second", [
    # Two modules of one package at the top of their files.
    ("moeless.serving", "from moeless.serving import planted_b\n", "from moeless.serving import planted_a\n"),
    # In a nested package, one end inside a function (a command's deferred import).
    ("moeless.controller.pool", "def late():\n    from moeless.controller.pool import planted_b  # deferred\n",
     "from moeless.controller.pool import planted_a\n"),
])
def test_a_planted_circle_inside_a_package_fails(tmp_path: Path, package: str, first: str, second: str):
    tree = package_tree(tmp_path)
    plant(tree, f"{package}.planted_a", first)
    plant(tree, f"{package}.planted_b", second)
    assert cycles(tree) == [f"{package}.planted_a -> {package}.planted_b (l.{first.count(chr(10))}) "
                            f"-> {package}.planted_a (l.1)"]
