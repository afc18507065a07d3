"""`moeless` subcommands of moeless.expert_fn (registered by moeless.cli)."""

from __future__ import annotations

import argparse


def register(commands: argparse._SubParsersAction, benches: argparse._SubParsersAction) -> None:
    """Add `moeless expert-host` and `moeless bench expert-invoke`."""
    from moeless.expert_fn.host import add_host_arguments

    host = commands.add_parser(
        "expert-host",
        help="run one expert host (gRPC server of expert replicas) in the foreground",
        description="Serve replicas of (layer, expert) FFNs from a weight store over gRPC until SIGTERM "
        "(then drain gracefully). Prints a JSON ready line with the chosen ports.",
    )
    add_host_arguments(host)
    host.set_defaults(func=_expert_host)


def _expert_host(args: argparse.Namespace) -> int:
    from moeless.expert_fn.host import serve

    return serve(args)
