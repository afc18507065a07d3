"""The data plane's options by name, and the host-tier flags: no torch or grpc, so `moeless --help`,
the operator and the CLI's checks read them without loading either."""

from __future__ import annotations

import argparse

COMPUTE_DTYPES = ("float32", "store")  # expert-host --compute-dtype: float32, or the store's own dtype (tiers.py)
TRANSPORTS = ("auto", "local", "tcp", "nixl", "grpc")  # a client's data path to a host (client.py)
EVICTION_ORDERS = ("lru", "fifo")  # which host-tier entry goes first (tiers.HostTier)
PREWARM = ("none", "all")  # what the host tier reads at start
PEER_COPIES = ("measured", "always", "off")  # when a load given a peer copies from it (host/peer_copy.py)
PEER_ASK_MB = 1024  # the most MiB one ask of a peer carries by default (host/peer_batches.py ASK_BYTES)


def add_tier_arguments(parser: argparse.ArgumentParser) -> None:
    """The host-tier flags of an expert host (--host-tier-gb, --host-tier-eviction, --host-tier-prewarm);
    tiers.tier_config_from_args reads them."""
    parser.add_argument("--host-tier-gb", type=float, default=None, metavar="G",
                        help="host memory for verified expert weights (GB = 1e9 bytes; 0 turns the tier off; default: no limit)")
    parser.add_argument("--host-tier-eviction", choices=EVICTION_ORDERS, default="lru",
                        help="which host-tier entry goes first when it is full (default lru)")
    parser.add_argument("--host-tier-prewarm", choices=PREWARM, default="none",
                        help="read every expert into host memory at start, as capacity allows (default none)")
