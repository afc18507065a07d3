"""The Expert Placer: which GPU each replica of one layer goes on, and each replica's token share.

- `place_jsq_warm`: the paper's Algorithm 2. Replicas from most to least loaded; a replica whose
  expert was resident on a GPU in the previous placement stays there when that GPU has room
  (warm start), however loaded it is; otherwise join-shortest-queue (least-loaded GPU with room).
- `place_priced` (placement/priced_placer.py): moeless's previous default (moeless-greedy), pricing warm reuse;
  moeless's default plans counts and GPUs together (placement/fill_placer.py).
- `place_round_robin`: the "placer off" ablation: blocks as static EP, extra replicas round-robin.

All take free replica slots per GPU ([G] int, what earlier layers left) and return the
updated slots. Two replicas of one expert never share a GPU (they would gain nothing). An extra
replica is placed only while enough slots stay free for every expert's first replica.
"""

from __future__ import annotations


import numpy as np

from moeless.placement.types import LayerPlacement, PlacementError

INF = float("inf")

class _Gpus:
    """Work and free slots per GPU, with the rule that first replicas always keep room.

    `queue[g]` is GPU g's work while it can take a replica of the current expert, else inf, so
    the least-loaded eligible GPU is one C-level min().
    """

    def __init__(self, free_slots: np.ndarray, num_experts: int, gpu_load: np.ndarray | None = None):
        self.free = [int(s) for s in free_slots]
        self.total = sum(self.free)
        self.unplaced = num_experts  # experts that still lack their first replica
        if self.total < num_experts:
            raise PlacementError(
                f"{self.total} free replica slots cannot hold {num_experts} experts; add GPU memory or GPUs"
            )
        if gpu_load is not None and np.shape(gpu_load) != (len(self.free),):
            raise ValueError(f"gpu_load must be [G] = [{len(self.free)}], got shape {np.shape(gpu_load)}")
        self.work = [0.0] * len(self.free) if gpu_load is None else [float(w) for w in gpu_load]
        self.queue = [w if f > 0 else INF for w, f in zip(self.work, self.free)]
        self.all = range(len(self.free))

    def spare(self) -> int:
        """Slots left beyond every missing first replica (extra replicas may use them)."""
        return self.total - self.unplaced

    def least(self, among: list[int] | range) -> int:
        """The least-loaded eligible GPU of `among` (ties: the first), or -1."""
        if not among:
            return -1
        if among is self.all:  # the common case: one C-level min over the queue, no key calls
            work = min(self.queue)
            return self.queue.index(work) if work < INF else -1
        g = among[0] if len(among) == 1 else min(among, key=self.queue.__getitem__)
        return g if self.queue[g] < INF else -1

    def hold(self, g: int) -> None:
        """GPU g now holds the current expert: no second replica of it there."""
        self.queue[g] = INF

    def take(self, g: int, first: bool, work: float) -> None:
        self.free[g] -= 1
        self.total -= 1
        self.unplaced -= first
        self.work[g] += work

    def take_alone(self, g: int, work: float) -> None:
        """GPU g takes an expert's only replica: it is eligible again at once (take, then release)."""
        self.take(g, True, work)
        self.queue[g] = self.work[g] if self.free[g] > 0 else INF

    def release(self, gpus: list[int]) -> None:
        """The current expert is done: its GPUs are eligible again for the next one."""
        for g in gpus:
            self.queue[g] = self.work[g] if self.free[g] > 0 else INF


def _warm_map(previous: LayerPlacement | None, num_experts: int) -> list[list[int]]:
    """GPUs on which each expert was resident in the previous placement: E lists."""
    warm: list[list[int]] = [[] for _ in range(num_experts)]
    if previous is not None:
        for e, g in zip(previous.expert.tolist(), previous.gpu.tolist()):
            if e < num_experts:
                warm[e].append(g)
    return warm


def _check(load: np.ndarray, logcnt: np.ndarray, free_slots: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    load = np.asarray(load, dtype=np.float64)
    logcnt = np.asarray(logcnt, dtype=np.int64)
    if load.ndim != 1 or load.shape != logcnt.shape:
        raise ValueError(f"load and logcnt must both be [E]; got {load.shape} and {logcnt.shape}")
    if not np.isfinite(load).all() or (load < 0).any():
        raise ValueError("loads must be finite, non-negative token counts; check the forecast")
    if (logcnt < 1).any():
        raise ValueError("every expert needs at least one replica (logcnt >= 1)")
    if np.asarray(free_slots).size == 0:
        raise ValueError("placement needs at least one GPU; got zero GPUs")
    return load, logcnt


def place_jsq_warm(
    load: np.ndarray,
    logcnt: np.ndarray,
    free_slots: np.ndarray,
    previous: LayerPlacement | None = None,
    gpu_load: np.ndarray | None = None,
) -> tuple[LayerPlacement, np.ndarray]:
    """The paper's placer. load: [E] tokens, logcnt: [E] replicas, free_slots: [G], gpu_load: [G]
    tokens the GPUs already carry (default none).

    Returns the layer's placement (even shares) and the free slots left: [G].
    """
    load, logcnt = _check(load, logcnt, free_slots)
    num_experts = load.shape[0]
    gpus, warm = _Gpus(free_slots, num_experts, gpu_load), _warm_map(previous, num_experts)
    per_replica = load / logcnt
    counts, loads = logcnt.tolist(), per_replica.tolist()
    experts, placed = [], []
    # 1. Replicas from most to least loaded (an expert's replicas are equal, so they come together).
    for e in np.argsort(-per_replica, kind="stable").tolist():
        held: list[int] = []
        for r in range(counts[e]):
            if r and gpus.spare() <= 0:
                break
            # 2. Warm start on the least-loaded GPU where the expert was resident and room is left ...
            g = gpus.least(warm[e])
            # 3. ... else join the shortest queue.
            if g < 0:
                g = gpus.least(gpus.all)
            if g < 0:
                break
            gpus.take(g, not held, loads[e])
            gpus.hold(g)
            held.append(g)
        if not held:
            raise PlacementError(f"no GPU has room for expert {e}'s first replica")
        gpus.release(held)
        experts.extend([e] * len(held))
        placed.extend(held)
    layer = LayerPlacement.even(np.array(experts), np.array(placed), num_experts)
    return layer, np.array(gpus.free, dtype=np.int64)

def place_round_robin(load: np.ndarray, logcnt: np.ndarray, free_slots: np.ndarray) -> tuple[LayerPlacement, np.ndarray]:
    """The "placer off" ablation: expert e's first replica on GPU e*G//E (static EP's blocks), its
    extra replicas on the following GPUs in turn; loads are ignored. Returns placement and slots."""
    load, logcnt = _check(load, logcnt, free_slots)
    num_experts, num_gpus = load.shape[0], len(free_slots)
    gpus = _Gpus(free_slots, num_experts)
    experts, placed = [], []
    for e in range(num_experts):
        home, held = e * num_gpus // num_experts, 0
        for step in range(num_gpus):
            if held == logcnt[e] or (held and gpus.spare() <= 0):
                break
            g = (home + step) % num_gpus
            if gpus.free[g] > 0:
                gpus.take(g, not held, 0.0)
                experts.append(e)
                placed.append(g)
                held += 1
        if not held:
            raise PlacementError(f"no GPU has room for expert {e}'s first replica")
    layer = LayerPlacement.even(np.array(experts), np.array(placed), num_experts)
    return layer, np.array(gpus.free, dtype=np.int64)
