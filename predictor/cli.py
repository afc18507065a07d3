"""`moeless` subcommands of moeless.predictor (registered by moeless.cli)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, benches: argparse._SubParsersAction) -> None:
    """Add this component's subcommands and benchmarks (none yet)."""
