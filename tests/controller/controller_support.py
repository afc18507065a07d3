"""What the controller's pure tests share: a small deployment's shape (L layers, E experts, G hosts), a
cost profile, and a host's status() as a plain dict."""

from moeless.placement.profile import CostProfile

L, E, G = 2, 4, 2
PROFILE = CostProfile(alpha=1e-6, beta=0.0, call_overhead=1e-6, load_s={"disk": 1e-4, "host": 1e-6},
                      expert_bytes=1000, non_expert_bytes=10_000, relevel_s=1e-5, source="test")


def status(replicas, memory=1_000_000, health="serving"):
    """A host's status() with replicas [(layer, expert, state)]."""
    return {"memory_bytes": memory, "health": health, "keep_alive_s": 60.0, "meters": {"gb_s": 0.0},
            "replicas": [{"layer": l, "expert": e, "state": s} for l, e, s in replicas]}


def homes(g, state="idle"):
    """Host g's static EP homes of every layer, in `state`."""
    return [(l, e, state) for l in range(L) for e in range(E) if e * G // E == g]
