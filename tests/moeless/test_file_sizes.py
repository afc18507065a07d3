"""Every Python file of the repository is under 350 lines, except the generated gRPC modules
(*_pb2*.py): past that, a module has a second job to split out along its seam (issue 42)."""

from __future__ import annotations

from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
LIMIT = 350


def python_files() -> list[Path]:
    """Every .py file under the checkout but hidden folders (.venv, .git, .ci's caches), build
    outputs (*.egg-info, __pycache__) and the generated *_pb2*.py."""
    return sorted(path for path in ROOT.rglob("*.py")
                  if not any(part.startswith(".") or part.endswith(".egg-info") or part == "__pycache__"
                             for part in path.relative_to(ROOT).parts[:-1])
                  and "_pb2" not in path.name)


def test_every_python_file_is_under_the_limit():
    files = python_files()
    assert len(files) > 100 and ROOT / "moeless" / "cli.py" in files and ROOT / "scripts" / "k8s_helm_e2e.py" in files
    long = {str(path.relative_to(ROOT)): n for path in files if (n := len(path.read_text().splitlines())) >= LIMIT}
    assert not long, f"files of {LIMIT} lines or more (split each along its seam, one job per module): {long}"


def test_the_generated_modules_are_the_only_ones_left_out():
    left_out = {path.name for path in ROOT.rglob("*_pb2*.py") if ".venv" not in path.parts}
    assert left_out == {"expert_host_pb2.py", "expert_host_pb2_grpc.py"}
