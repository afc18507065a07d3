"""`moeless expert-host` (registered by moeless.cli; `moeless bench expert-invoke` is in
moeless.bench.expert_invoke)."""

from __future__ import annotations

import argparse

from moeless.expert_fn.host.main import add_host_arguments, serve


def register(commands: argparse._SubParsersAction) -> None:
    """Add `moeless expert-host`."""
    host = commands.add_parser(
        "expert-host",
        help="run one expert host (gRPC server of expert replicas) in the foreground",
        description="Serve replicas of (layer, expert) FFNs from a weight store over gRPC until SIGTERM "
        "(then drain gracefully). Prints a JSON ready line with the chosen ports.",
    )
    add_host_arguments(host)
    host.set_defaults(func=_expert_host)


def _expert_host(args: argparse.Namespace) -> int:
    return serve(args)
