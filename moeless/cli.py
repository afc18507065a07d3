"""The `moeless` command line. Each component registers its own subcommands; moeless.bench the benchmarks.

Heavy imports (torch, numba, grpc, ray) happen inside the commands, and the benches register
only for `moeless bench ...`, so `--help` and every other command start fast (a test holds it).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moeless.bench import BENCH_MODULES

# Modules with `register(commands)`: each adds its component's subcommands to `moeless`. The benches
# (`moeless bench X`) are in moeless.bench, each module with `register(benches)`.
COMMAND_MODULES = (
    "moeless.model.cli",
    "moeless.predictor.cli",
    "moeless.controller.operator.cli",
    "moeless.expert_fn.cli",
    "moeless.serving.cli",
    "moeless.evaluation.cli",
    "moeless.twin.cli",
)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The whole `moeless` parser; given argv, the benches (which import torch and the rest) only
    where argv runs `moeless bench`, so every other command and `moeless --help` start fast."""
    parser = argparse.ArgumentParser(
        prog="moeless",
        description="Serverless experts for Mixture-of-Experts LLM serving.",
    )
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    bench = commands.add_parser(
        "bench",
        help="benchmarks: each prints its figures against a baseline measured in the same run",
        description="Benchmarks. Each takes --out DIR (JSON there) and --quick (under a minute).",
    )
    benches = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    for name in COMMAND_MODULES:
        importlib.import_module(name).register(commands)
    command = next((word for word in argv if not word.startswith("-")), None) if argv is not None else "bench"
    if command == "bench":
        for name in BENCH_MODULES:
            importlib.import_module(name).register(benches)
    return parser


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
