"""`moeless eval --shared-pool --finetunes N ... --replaced SHARE ...`: N fine-tunes of a base on one
pool four ways (twin/finetunes.py), for every base, replaced share, fine-tune count and load level,
into RUN_DIR/run.json (format moeless-shared-pool-finetunes/3); finetune_report.py renders it
(docs/shared-pool.md, "Many fine-tunes of one base").

In numbered steps:
1. Per base (a geometry on the GPU type): its PoolModel as `moeless eval --shared-pool` makes a
   model's (shared_pool_run.pool_model: its dedicated G, the roofline's costs) and its routing on
   each workload's prompts (shared_pool_run.popularity).
2. Per base, share and count N: N fine-tunes, fine-tune i on workload i mod 2 (its prompts' routing
   and its arrivals), its task's experts seeded by (seed, i): fine-tune i is the same in every N.
3. Per level: each fine-tune's requests as each model's in the shared pool (shared_pool_run.
   level_requests: the workload's Azure trace, the generated process where it is missing, thinned to
   the level and shifted by i/N of it), then twin/finetunes.evaluate_finetunes.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moeless.evaluation.deployment import MEM_FRACTION, DeploymentError
from moeless.evaluation.lengths import dataset_lengths
from moeless.evaluation.shared_pool_run import (
    RUN_FILE,
    WORKLOADS,
    SharedPoolConfig,
    check_levels,
    level_requests,
    pool_model,
    popularity,
)
from moeless.hardware.gpus import gpu_spec
from moeless.twin import arrivals as arr
from moeless.twin.finetunes import evaluate_finetunes, make_finetune, replaced_counts
from moeless.twin.geometry import load_geometry
from moeless.twin.shared_pool import PoolSettings

FORMAT = "moeless-shared-pool-finetunes/3"  # 2: gated admission, scale-up waits; 3: base-warm wakes gated
BASES = ("mixtral-8x7b", "deepseek-v2-lite")
MAX_FINETUNES = 64


@dataclass(frozen=True)
class FineTuneConfig:
    """pool: the shared pool's settings (its geometries are the bases); finetunes: counts N;
    replaced: shares of each base's experts a fine-tune replaces."""

    pool: SharedPoolConfig = SharedPoolConfig(geometries=BASES)
    finetunes: tuple[int, ...] = (1, 4, 16)
    replaced: tuple[float, ...] = (0.05, 0.15)

    def __post_init__(self):
        if not self.finetunes or not all(1 <= n <= MAX_FINETUNES for n in self.finetunes):
            raise DeploymentError(f"--finetunes: counts from 1 to {MAX_FINETUNES}, got {' '.join(map(str, self.finetunes))}")
        if not self.replaced or not all(0 <= x < 1 for x in self.replaced):
            raise DeploymentError(f"--replaced: shares of a base's experts in [0, 1), got {' '.join(f'{x:g}' for x in self.replaced)}")

    def command(self, out: str) -> str:
        """The `moeless eval` command line that replays this run."""
        s, default = self.pool.settings, PoolSettings()
        knobs = [(flag, value) for flag, value, usual in (("--step-hold", s.step_hold_s, default.step_hold_s),
                                                          ("--step-lag", s.step_lag_s, default.step_lag_s),
                                                          ("--peer-copy-ms", s.peer_copy_s * 1e3, default.peer_copy_s * 1e3),
                                                          ("--peer-batch-mb", s.peer_batch_bytes / 1e6, default.peer_batch_bytes / 1e6))
                 if value != usual]
        copies = ("--scale-up-copies", s.scale_up_copies) if s.scale_up_copies != default.scale_up_copies else ()
        return self.pool.command(out, ("--finetunes", *map(str, self.finetunes), "--replaced",
                                       *(f"{x:g}" for x in self.replaced), *(a for f, v in knobs for a in (f, f"{v:g}")),
                                       *copies))


def evaluate_finetune_pools(config: FineTuneConfig, out: str | Path, progress: bool = True) -> dict:
    """Every (base, share, N, level) cell into directory `out`; returns the run document (also RUN_DIR/run.json)."""
    # 1. Inputs that can be wrong, before any work; then the bases.
    pc = config.pool
    gpu = gpu_spec(pc.gpu)
    out, s = Path(out), replace(pc.settings, gpu_bytes=MEM_FRACTION * gpu.memory)
    geometries = [load_geometry(g) for g in pc.geometries]
    if pc.routing not in ("moefied", "uniform"):
        raise DeploymentError(f"--routing {pc.routing!r}: the shared pool takes 'moefied' or 'uniform'")
    count = max(config.finetunes)
    workloads = [WORKLOADS[i % len(WORKLOADS)] for i in range(count)]
    found = {trace: arr.resolve(trace, pc.requests) for trace, _ in sorted(set(workloads))}
    check_levels(pc.levels, found)
    lengths = {prompts: dataset_lengths(prompts, 1000) for _, prompts in set(workloads)}
    bases, cells = [], []
    for geo in geometries:
        routings = {prompts: popularity(geo, pc.routing, prompts, pc, progress) for _, prompts in sorted(set(workloads))}
        base = pool_model(geo, gpu, next(iter(routings.values()))[0], s.peer_copy_s)
        base = base if s.scale_up_copies == "peer" else replace(base, expert_peer_s=None)  # loaded from host memory
        bases.append(_base_doc(base, routings, config.replaced))
        # 2-3. Each share and count: the fine-tunes; each level: their requests, then the pool.
        for share in config.replaced:
            finetunes = [make_finetune(base, f"{geo.name}+ft{i}", routings[workloads[i][1]][0], share,
                                       np.random.default_rng([s.seed, i])) for i in range(count)]
            for n in tqdm(config.finetunes, desc=f"{geo.name}, {share:g} replaced", disable=not progress):
                for per_minute in pc.levels:
                    rng = np.random.default_rng(s.seed)
                    requests = [level_requests(found[trace], *lengths[prompts][:2], per_minute, i / n, s.horizon_s, rng)
                                for i, (trace, prompts) in enumerate(workloads[:n])]
                    cells.append({"base": geo.name, "replaced": share, "finetunes": n, "requests_per_minute": per_minute,
                                  **evaluate_finetunes(finetunes[:n], requests, s)})
    run = {"format": FORMAT, "command": config.command(str(out)), "gpu": gpu.name,
           "gpu_bytes_for_weights": MEM_FRACTION * gpu.memory, "settings": asdict(s), "bases": bases,
           "workloads": [f"{trace} arrivals, {prompts} lengths ({lengths[prompts][2]}; {found[trace].source})"
                         for trace, prompts in WORKLOADS[:count]],
           "cells": cells}
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    return run


def _base_doc(base, routings: dict[str, tuple[np.ndarray, str]], shares: tuple[float, ...]) -> dict:
    """What the report says of a base: sizes, load times, routing, experts a fine-tune owns per share."""
    return {"name": base.name, "dedicated_gpus": base.gpus, "weight_gb": base.weight_bytes / 1e9,
            "non_expert_gb": base.non_expert_bytes / 1e9, "expert_mb": base.expert_bytes / 1e6, "layers": base.layers,
            "experts": base.experts, "top_k": base.top_k, "expert_load_ms": 1e3 * base.expert_load_s,
            "non_expert_load_ms": 1e3 * base.non_expert_load_s, "whole_load_s": base.whole_load_s,
            "routing": sorted({label for _, label in routings.values()}),
            "own_experts": {f"{x:g}": int(replaced_counts(base.layers, base.experts, x).sum()) for x in shares}}
