"""`moeless eval --geometry ...`: every (model, GPUs, workload) cell into RUN_DIR/run.json
(format moeless-deployments/1); evaluation/deployment.py runs one cell, deployment_report.py
renders the run.

Inputs are checked before any work (geometries, GPUs, a routing file's (E, k) against each
geometry, the traces), so a bad one costs one error line.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from moeless.controller.knobs import Knobs
from moeless.evaluation.deployment import DeploymentError, DeploymentSizes, iterations_for, run_cell
from moeless.evaluation.lengths import dataset_lengths
from moeless.evaluation.workload import Sizes, WorkloadSpec, read_arrivals
from moeless.hardware.gpus import parse_gpu_arg
from moeless.traces.recording import moefied_routing
from moeless.traces.shipped import load_named_routing
from moeless.twin.geometry import Geometry, load_geometry
from moeless.twin.roofline import resolve_profile

FORMAT = "moeless-deployments/1"
RUN_FILE = "run.json"


@dataclass(frozen=True)
class DeploymentConfig:
    """geometries (names or config.json paths), gpus (NAME[xCOUNT]), workloads, routing ("moefied",
    a shipped log's name or a routing file), sizes, knobs, profile (a real cost profile: replaces every roofline)."""

    geometries: tuple[str, ...]
    gpus: tuple[str, ...]
    workloads: tuple[WorkloadSpec, ...]
    routing: str = "moefied"
    sizes: DeploymentSizes = DeploymentSizes()
    knobs: Knobs = Knobs()
    profile: str | None = None
    quick: bool = False

    def command(self, out: str) -> str:
        """The `moeless eval` command line that replays this run (every setting spelled out)."""
        s, k = self.sizes, self.knobs
        args = ["moeless", "eval", "--geometry", *self.geometries, "--gpu", *self.gpus]
        for w in self.workloads:
            args += ["--workload", f"{w.name}={w.trace or 'generated'}:{w.prompts}"]
        args += ["--routing", self.routing, "--max-batched-tokens", s.max_batched_tokens, "--max-seqs", s.max_seqs,
                 "--load", f"{s.load:g}", "--requests", s.requests, "--max-iterations", s.max_iterations,
                 "--step-ms", f"{s.step_s * 1e3:g}", "--prompt-count", s.routing_prompts, "--new-tokens", s.routing_tokens,
                 "--keep-alive", f"{k.keep_alive_s:g}", "--cv-threshold", f"{k.cv_threshold:g}"]
        if k.memory_price is not None:
            args += ["--memory-price", f"{k.memory_price:g}"]
        args += [*(["--profile", self.profile] if self.profile else []), "--out", out]
        return " ".join(shlex.quote(str(a)) for a in args)


def routing_for(config: DeploymentConfig, geometry: Geometry, prompts: str, progress: bool):
    """The cell's routing: a shipped log by name or a routing file (checked against the geometry's E
    and k), or moefied routing recorded on `prompts` (a dataset name)."""
    if config.routing != "moefied":
        routing = load_named_routing(config.routing)
        if (routing.num_experts, routing.top_k) != (geometry.num_experts, geometry.top_k):
            raise DeploymentError(f"--routing {config.routing}: E={routing.num_experts}, k={routing.top_k}, but {geometry.name} "
                                  f"has E={geometry.num_experts}, k={geometry.top_k}; record its routing or use --routing moefied")
        return routing
    return moefied_routing(geometry.num_experts, geometry.top_k, prompts, config.sizes.routing_prompts,
                           config.sizes.routing_tokens, progress=progress)[0]


def evaluate_deployments(config: DeploymentConfig, out: str | Path, progress: bool = True) -> dict:
    """Every cell into directory `out`; returns the run document (also RUN_DIR/run.json)."""
    out = Path(out)
    s = config.sizes
    # 1. Inputs that can be wrong, before any work.
    geometries = [load_geometry(g) for g in config.geometries]
    gpus = [parse_gpu_arg(g) for g in config.gpus]
    arrivals = {w.name: read_arrivals(w, Sizes(requests=s.requests)) for w in config.workloads}
    if config.routing != "moefied":
        for g in geometries:
            routing_for(config, g, "sharegpt", progress)
    # 2. Cells: routing per (model, prompts), iterations per (model, GPU, workload), the planners.
    cells = []
    with tqdm(total=len(geometries) * len(gpus) * len(config.workloads), desc="deployment cells", disable=not progress) as bar:
        for geo in geometries:
            for w in config.workloads:
                routing = routing_for(config, geo, w.prompts, progress)
                prompts, outputs, lengths_note = dataset_lengths(w.prompts, s.requests)
                iterations = iterations_for(routing, prompts, outputs, arrivals[w.name].seconds, s, geo.moe_layers)
                for (gpu, count), gpu_arg in zip(gpus, config.gpus):
                    profile = resolve_profile(config.profile, geo, gpu, count)
                    doc = run_cell(iterations, profile, gpu, count, geo.top_k, config.knobs)
                    cells.append({"model": geo.name, "gpu": gpu.name, "count": count, "gpu_arg": gpu_arg, "workload": w.name,
                                  "prompts": w.prompts, "arrivals": arrivals[w.name].source, "lengths": lengths_note,
                                  "routing": routing.label, "routing_layers": routing.num_layers, "layers": geo.moe_layers,
                                  "experts": geo.num_experts, "top_k": geo.top_k, "profile": asdict(profile), **doc})
                    bar.update(1)
    out.mkdir(parents=True, exist_ok=True)
    run = {"format": FORMAT, "command": config.command(str(out)), "quick": config.quick, "sizes": asdict(s),
           "knobs": config.knobs.to_mapping(), "cells": cells}
    (out / RUN_FILE).write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    return run
