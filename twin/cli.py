"""The twin's command: `moeless plan` (one plan for given loads, priced by a cost profile; `moeless
trace` is traces/cli.py's)."""

from __future__ import annotations

import argparse
import sys

import numpy as np

from moeless.model.shape import DEFAULT_EXPERT_SHAPE
from moeless.placement.names import DEFAULT_PLANNER


def register(commands: argparse._SubParsersAction) -> None:
    """Add `moeless plan`."""
    plan = commands.add_parser(
        "plan",
        help="plan one iteration's placement from per-layer expert loads and print it",
        description="Runs a planner on loads [L, E] (a .npy file; [B, L, E]: samples of the batches to come, for "
                    "moeless-sets; for moeless, the batches its gates reported, one plan after each, so that it may "
                    "move homes: it prints each move and why) and prints, per layer, each GPU's replicas "
                    "(expert:share), the predicted layer time "
                    "under the paper's and the serial execution model, and why each copy was chosen: what it saves "
                    "on these loads with each call paired (placement/dispatch.py) against its price (its load and "
                    "the memory it holds, at --memory-price seconds per GB·s).",
    )
    plan.add_argument("loads", help=".npy file of token counts per expert, shape [L, E] (or [E] for one layer)")
    plan.add_argument("--planner", default=DEFAULT_PLANNER,
                      help="a planner name (moeless, paper, static, eplb, eplb-global, oracle, ablations) "
                           "or 'module:function' (default moeless)")
    plan.add_argument("--gpus", type=int, default=8, help="GPUs (default 8)")
    plan.add_argument("--layer-cap", type=float, default=2.0, help="replicas per layer, in multiples of E (default 2)")
    plan.add_argument("--cv-threshold", type=float, default=0.2, help="the paper's CV threshold V (default 0.2)")
    plan.add_argument("--eplb-replicas", type=int, default=None, help="EPLB's replicas per layer (a multiple of --gpus)")
    plan.add_argument("--profile", metavar="JSON", help="a cost profile (default: measured now at the default model's expert shape)")
    plan.add_argument("--move-after", type=int, default=10,
                      help="moeless: plans of the gates' loads before its first chance to move homes (default 10)")
    plan.add_argument("--move-every", type=int, default=50,
                      help="moeless: plans between its chances to move homes after that (default 50; 0: never)")
    plan.add_argument("--memory-price", type=float, default=0.0,
                      help="seconds of layer time one GB·s of replica memory is worth (default 0: memory free)")
    plan.set_defaults(func=plan_command)


def plan_command(args: argparse.Namespace) -> int:
    # compiled kernels (numba): kept off --help's start-up path
    from moeless.placement.cluster import Cluster
    from moeless.placement.planner import PlannerConfig, get_planner
    from moeless.placement.profile import CostProfile, ProfileError

    if args.move_after < 1 or args.move_every < 0:
        print(f"moeless plan: --move-after must be 1 or more and --move-every 0 or more; got {args.move_after}, "
              f"{args.move_every}", file=sys.stderr)
        return 2
    loads = np.load(args.loads)
    loads = np.atleast_2d(loads) if loads.ndim < 3 else loads
    num_layers, num_experts = loads.shape[-2:]
    try:
        profile = CostProfile.from_json(args.profile) if args.profile else _measured_profile(num_experts, args.gpus)
    except ProfileError as err:
        print(f"moeless plan: {err}", file=sys.stderr)
        return 2
    model = profile.latency_model()
    cap = int(round(args.layer_cap * num_experts))
    cluster = Cluster.uniform(args.gpus, -(-num_layers * cap // args.gpus), expert_bytes=profile.expert_bytes,
                              layer_cap_replicas=cap)
    config = PlannerConfig(model=model, cv_threshold=args.cv_threshold, eplb_replicas=args.eplb_replicas,
                           gb_s_price=args.memory_price, dispatch_s=profile.relevel_s + profile.check_s,
                           home_moves_first=args.move_after, home_moves_every=args.move_every)
    planner = get_planner(args.planner, config)
    if loads.ndim == 3 and planner.state is not None:  # what its gates reported: a plan after each, loaded
        placement = None
        for batch in loads:
            planner.learn(batch)
            placement = planner(batch, cluster, placement)
    else:
        placement = planner(loads if planner.samples or loads.ndim == 2 else loads.mean(axis=0), cluster)
    for line in planner.describe():
        print(line)
    priced = loads.mean(axis=0) if loads.ndim == 3 else loads
    priced = planner.lossy_load(priced) if planner.lossy_load else priced
    for l, layer in enumerate(placement.layers):
        paper = model.layer_time(priced[l], layer, args.gpus, "paper")
        serial = model.layer_time(priced[l], layer, args.gpus, "serial")
        print(f"layer {l}: {layer.num_replicas} replicas, paper {paper * 1e6:.1f} us, serial {serial * 1e6:.1f} us")
        for g in range(args.gpus):
            mine = np.flatnonzero(layer.gpu == g)
            print(f"  gpu {g}: " + " ".join(f"{layer.expert[i]}:{layer.share[i]:.2f}" for i in mine))
        for line in _why(loads[:, l] if loads.ndim == 3 else loads[l][None], layer, config, profile, args.gpus):
            print("  " + line)
    return 0


def _why(samples: np.ndarray, layer, config, profile, num_gpus: int) -> list[str]:
    """Each copy (every replica after its expert's first): what removing it would cost the paired
    layer time on the samples, against its price (ReplicaCost: its exposed load and memory)."""
    # Deferred: the planners' numba kernels load only for `moeless plan`, not for the CLI's other verbs.
    from moeless.placement.replica_sets import mean_paired_seconds
    from moeless.placement.resident_planner import ReplicaCost

    _, first = np.unique(layer.expert, return_index=True)
    copies = np.setdiff1d(np.arange(layer.num_replicas), first)
    if not copies.size:
        return ["no copies: every token at its expert's home"]
    samples = np.rint(samples).astype(np.int64)
    cost = ReplicaCost(config.model, config.prefetch_layers, profile.expert_bytes, config.keep_alive_s, config.gb_s_price,
                       config.horizon, config.iteration_s)
    share = np.zeros(layer.num_replicas)
    share[first] = 1.0
    full_s = mean_paired_seconds(samples, layer.expert, layer.gpu, share, num_gpus, config.model)
    lines = []
    for r in copies:
        keep = np.arange(layer.num_replicas) != r
        without_s = mean_paired_seconds(samples, layer.expert[keep], layer.gpu[keep], share[keep], num_gpus, config.model)
        gain = (without_s - full_s) * cost.horizon
        lines.append(f"copy of expert {layer.expert[r]} on gpu {layer.gpu[r]}: saves {(without_s - full_s) * 1e6:.2f} us a "
                     f"call paired ({gain * 1e6:.1f} us over {cost.horizon:g} iterations) against its price "
                     f"{cost.cost(0, full_s) * 1e6:.1f} us (load not hidden + memory)")
    return lines


def _measured_profile(num_experts: int, num_gpus: int):
    """The cost profile measured now (a few repeats) at the default model's expert shape
    (non-expert bytes not measured: a plan does not bill them)."""
    from moeless.hardware.cpu_profile import measure_profile  # torch: off --help's start-up path

    profile, _ = measure_profile(*DEFAULT_EXPERT_SHAPE, non_expert_bytes=0, repeats=10, num_experts=num_experts,
                                       num_gpus=num_gpus)
    return profile
