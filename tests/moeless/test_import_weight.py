"""What a process imports, measured where it runs: a layer call's modules bring no Kubernetes client
(or Ray), and the operator checks a policy's planner by name without the planners' compiled kernels.

The contracts in pyproject.toml ("data-path", "pure-policies") hold the module graph; these run the
interpreter as a user does, with `-X importtime`, whose report names every module a process
imported, and look at what came in.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def imported(*args: str) -> set[str]:
    """The modules `python -X importtime ARGS` imported (its report on stderr), as they are named there."""
    # From outside the checkout: there, its own moeless/ folder would shadow the installed package.
    run = subprocess.run([sys.executable, "-X", "importtime", *args], capture_output=True, text=True, timeout=300,
                         cwd=ROOT.parent)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-2000:]
    rows = [line.rpartition("|")[2] for line in run.stderr.splitlines() if line.startswith("import time:")]
    return {row.strip() for row in rows}


def tops(modules: set[str]) -> set[str]:
    return {name.split(".")[0] for name in modules}


def test_a_layer_call_imports_no_kubernetes_client():
    modules = imported("-c", "import moeless.serving.executor, moeless.serving.live_executor, moeless.serving.live_engine, moeless.serving.relevel")
    assert {"moeless.serving.executor", "moeless.controller.pool.wake", "torch"} <= modules  # the report is read
    assert not tops(modules) & {"kubernetes", "urllib3", "ray"}, sorted(
        name for name in modules if name.split(".")[0] in ("kubernetes", "urllib3", "ray"))


def test_the_operator_names_planners_without_the_kernels():
    assert "numba" not in tops(imported("-m", "moeless", "operator", "--help"))
    # The operator at work: its shell and a policy's spec parsed, planner and all (it imports the
    # Kubernetes client; the planners' registry and numba stay out).
    check = ("from moeless.controller.operator import cli, loop\n"
             "from moeless.controller.operator.spec import parse_spec\n"
             "spec = parse_spec({'model': {'store': '/s'}, 'hosts': {'image': 'i', 'maxHosts': 2},\n"
             "                   'serving': {'planner': 'eplb-window'}})\n"
             "assert spec.knobs.planner == 'eplb-window'\n")
    modules = imported("-c", check)
    assert {"kubernetes", "moeless.controller.knobs"} <= tops(modules) | modules
    assert not tops(modules) & {"numba", "torch"}, f"the operator imported {sorted(tops(modules) & {'numba', 'torch'})}"
