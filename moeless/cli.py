"""The `moeless` command line. Each component registers its own subcommands; moeless.bench the benchmarks.

Heavy imports (torch, numba, grpc, ray) happen inside the commands, and a bench's module is
imported only for `moeless bench X`, so `--help`, `moeless bench --help` and every other command
start fast (a test holds it).
"""

from __future__ import annotations

import argparse
import importlib
import sys

from moeless.bench import BENCHES

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
    "moeless.traces.cli",
)


def build_parser(argv: list[str] | None = None) -> argparse.ArgumentParser:
    """The `moeless` parser (without argv: the whole of it). Given argv, a bench (its module imports
    torch and the rest) registers only where argv runs it, so every other command, `moeless
    --help` and `moeless bench --help` start fast."""
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
    words = [word for word in argv if not word.startswith("-")] if argv is not None else None
    if words is None:  # the whole parser: every bench with its flags
        for module in dict.fromkeys(entry.module for entry in BENCHES.values()):
            importlib.import_module(module).register(benches)
    elif words[:1] == ["bench"]:
        _register_benches(benches, words[1] if len(words) > 1 else None)
    return parser


def _register_benches(benches: argparse._SubParsersAction, chosen: str | None) -> None:
    """The chosen bench's module registers its benches with every flag; each other bench gets its
    line in `moeless bench --help` (moeless.bench.BENCHES) without importing its module."""
    module = BENCHES[chosen].module if chosen in BENCHES else None
    if module:
        importlib.import_module(module).register(benches)
    for name, bench in BENCHES.items():
        if bench.module != module:
            benches.add_parser(name, help=bench.help)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    args = build_parser(argv).parse_args(argv)
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
