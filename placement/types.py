"""The placement: which replicas of which experts exist, on which GPU, with what token share.

This is the one object that every planner (moeless, static EP, EPLB, Oracle) produces and the
serving path consumes. It converts to and from DeepSeek EPLB's (phy2log, log2phy, logcnt) triple.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from moeless.placement.kernels import largest_remainder


SHARE_TOLERANCE = 1e-9 + 1e-5  # |sum of an expert's shares - 1|, as np.isclose's default rtol + atol=1e-9


class PlacementError(ValueError):
    """A placement that violates its own invariants."""


@dataclass(frozen=True)
class LayerPlacement:
    """Replicas of one MoE layer.

    expert: [R] int   logical expert of each replica, in 0..E-1
    gpu:    [R] int   GPU (expert host) that holds each replica, in 0..G-1
    share:  [R] float fraction of its expert's tokens each replica receives; sums to 1 per expert
    """

    expert: np.ndarray
    gpu: np.ndarray
    share: np.ndarray

    @staticmethod
    def even(expert: np.ndarray, gpu: np.ndarray, num_experts: int) -> "LayerPlacement":
        """Replicas of one expert split its tokens evenly (the paper's rule)."""
        expert = np.asarray(expert, dtype=np.int64)
        counts = np.bincount(expert, minlength=num_experts)
        share = 1.0 / counts[expert]
        return LayerPlacement(expert, np.asarray(gpu, dtype=np.int64), share.astype(np.float64))

    @property
    def num_replicas(self) -> int:
        return int(self.expert.shape[0])

    def logcnt(self, num_experts: int) -> np.ndarray:
        """Replicas per expert: [E] int."""
        return np.bincount(self.expert, minlength=num_experts)

    def replica_tokens(self, expert_tokens: np.ndarray) -> np.ndarray:
        """Whole tokens per replica for given per-expert token counts.

        expert_tokens: [E] int -> [R] int. Each expert's tokens are divided by share with the
        largest-remainder rule, so counts are whole and sum exactly to the expert's tokens;
        ties go to the lower replica index (deterministic).
        """
        return largest_remainder(np.asarray(expert_tokens, dtype=np.int64), self.expert, np.asarray(self.share, dtype=np.float64))

    def gpu_tokens(self, expert_tokens: np.ndarray, num_gpus: int) -> np.ndarray:
        """Tokens each GPU computes: [G] int."""
        return np.bincount(self.gpu, weights=self.replica_tokens(expert_tokens), minlength=num_gpus).astype(np.int64)


@dataclass(frozen=True)
class Placement:
    """A placement of all L MoE layers over G GPUs (expert hosts).

    release: [n, 3] (layer, expert, gpu) replicas the planner let go of (a moved home's old one):
    whoever runs the plan evicts each at once when it is resident, not in the plan, and a planned
    replica of its expert is resident (until then it stands in), instead of after keep-alive.
    """

    layers: tuple[LayerPlacement, ...]
    num_experts: int
    num_gpus: int
    release: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), np.int64), compare=False)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        """Raise PlacementError unless every expert has a replica and shares sum to 1."""
        if self.num_gpus <= 0:
            raise PlacementError(f"a placement needs at least one GPU, got num_gpus={self.num_gpus}")
        for l, lp in enumerate(self.layers):
            if not (lp.expert.shape == lp.gpu.shape == lp.share.shape) or lp.expert.ndim != 1:
                raise PlacementError(f"layer {l}: expert, gpu and share must be 1-D arrays of one length")
            if lp.num_replicas and (lp.expert.min() < 0 or lp.expert.max() >= self.num_experts):
                raise PlacementError(f"layer {l}: expert ids must be in 0..{self.num_experts - 1}")
            if lp.num_replicas and (lp.gpu.min() < 0 or lp.gpu.max() >= self.num_gpus):
                raise PlacementError(f"layer {l}: gpu ids must be in 0..{self.num_gpus - 1}")
            missing = np.flatnonzero(lp.logcnt(self.num_experts) == 0)
            if missing.size:
                raise PlacementError(f"layer {l}: experts {missing.tolist()} have no replica")
            if (lp.share < 0).any():
                raise PlacementError(f"layer {l}: negative token share")
            # Planners validate every plan, so this stays plain arithmetic (np.isclose costs more than the plan).
            off = np.abs(np.bincount(lp.expert, weights=lp.share, minlength=self.num_experts) - 1.0) > SHARE_TOLERANCE
            if off.any():
                raise PlacementError(f"layer {l}: token shares of experts {np.flatnonzero(off).tolist()} do not sum to 1")

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    def replicas(self) -> set[tuple[int, int, int]]:
        """(layer, expert, gpu) of every replica."""
        return {(l, e, g) for l, lp in enumerate(self.layers) for e, g in zip(lp.expert.tolist(), lp.gpu.tolist())}

    def releasable(self, resident: np.ndarray) -> list[tuple[int, int, int]]:
        """(layer, expert, gpu) of `release` to evict now, given resident [L, E, G] bool: resident,
        not planned, and a planned replica of the same expert resident."""
        return [(l, e, g) for l, e, g in self.release.tolist()
                if resident[l, e, g] and not ((lp := self.layers[l]).expert == e)[lp.gpu == g].any()
                and resident[l, e, lp.gpu[lp.expert == e]].any()]

    def logcnt(self) -> np.ndarray:
        """Replicas per expert: [L, E] int."""
        return np.stack([lp.logcnt(self.num_experts) for lp in self.layers])

    @staticmethod
    def static(num_layers: int, num_experts: int, num_gpus: int) -> "Placement":
        """Static expert parallelism (Megatron-LM): one replica per expert, contiguous blocks per GPU."""
        if num_gpus <= 0:
            raise PlacementError(f"a placement needs at least one GPU, got num_gpus={num_gpus}")
        expert = np.arange(num_experts)
        gpu = expert * num_gpus // num_experts
        layer = LayerPlacement.even(expert, gpu, num_experts)
        return Placement(tuple(layer for _ in range(num_layers)), num_experts, num_gpus)

    def to_eplb(self) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """EPLB's triple. Needs the same replica count R per layer, divisible by G, with replicas
        stored GPU by GPU (R/G slots per GPU) and even shares.

        Returns phy2log [L, R], log2phy [L, E, max_cnt] (-1 padded), logcnt [L, E].
        """
        counts = {lp.num_replicas for lp in self.layers}
        if len(counts) != 1 or next(iter(counts)) % self.num_gpus:
            raise PlacementError("to_eplb needs the same replica count in every layer, a multiple of the GPU count")
        num_phy = next(iter(counts))
        per_gpu = num_phy // self.num_gpus
        phy2log = np.empty((self.num_layers, num_phy), dtype=np.int64)
        for l, lp in enumerate(self.layers):
            if not np.array_equal(np.bincount(lp.gpu, minlength=self.num_gpus), np.full(self.num_gpus, per_gpu)):
                raise PlacementError(f"layer {l}: to_eplb needs {per_gpu} replicas on every GPU")
            if not np.allclose(lp.share, 1.0 / lp.logcnt(self.num_experts)[lp.expert]):
                raise PlacementError(f"layer {l}: to_eplb needs even token shares")
            order = np.argsort(lp.gpu, kind="stable")
            phy2log[l] = lp.expert[order]
        logcnt = self.logcnt()
        log2phy = np.full((self.num_layers, self.num_experts, int(logcnt.max())), -1, dtype=np.int64)
        for l in range(self.num_layers):
            for e in range(self.num_experts):
                slots = np.flatnonzero(phy2log[l] == e)
                log2phy[l, e, : slots.size] = slots
        return phy2log, log2phy, logcnt

    @staticmethod
    def from_eplb(phy2log: np.ndarray, num_experts: int, num_gpus: int) -> "Placement":
        """Physical slot p lives on GPU p // (R / G), as in EPLB; tokens split evenly.

        phy2log: [L, R] int with R a multiple of num_gpus.
        """
        phy2log = np.asarray(phy2log, dtype=np.int64)
        if phy2log.ndim != 2 or phy2log.shape[1] % num_gpus:
            raise PlacementError("phy2log must be [L, R] with R a multiple of the GPU count")
        per_gpu = phy2log.shape[1] // num_gpus
        gpu = np.arange(phy2log.shape[1]) // per_gpu
        layers = tuple(LayerPlacement.even(row, gpu, num_experts) for row in phy2log)
        return Placement(layers, num_experts, num_gpus)
