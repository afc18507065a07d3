"""`moeless eval --shared-pool`: several models on one pool of GPUs, three ways, at several load levels
(twin/shared_pool.py), into RUN_DIR/run.json (format moeless-shared-pool/2); shared_pool_report.py
renders it (docs/shared-pool.md).

In numbered steps:
1. Per model (a geometry on the GPU type): its dedicated GPU count G (the fewest that hold static
   EP, evaluation/deployment.gpu_slots), the roofline's cost profile on G GPUs (expert bytes, loads
   from the host tier, compute), routing popularity per layer ("moefied": the default model rebuilt
   at the geometry's E and k routes real prompts; "uniform": every expert alike).
2. Per model and level: its arrivals, the workload's trace (Azure conversation or code, the
   generated process where the file is missing) thinned to the level's requests per minute (each
   arrival kept with probability level / the trace's rate, seeded: a less popular model with the
   trace's own bursts and lulls) and shifted by i/N of the trace for model i (so bursts do not
   line up), with the prompt and output lengths of the workload's dataset.
3. The pool, each level: twin/shared_pool.evaluate_pool.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np
from tqdm import tqdm

from moeless.evaluation.deployment import MEM_FRACTION, DeploymentError, gpu_slots
from moeless.evaluation.lengths import dataset_lengths
from moeless.hardware.gpus import GpuSpec, gpu_spec
from moeless.twin import arrivals as arr
from moeless.twin.geometry import Geometry, load_geometry
from moeless.twin.roofline import PEER_COPY_S, roofline_profile
from moeless.twin.shared_pool import PoolModel, PoolSettings, Requests, evaluate_pool

FORMAT = "moeless-shared-pool/2"  # 2: the p99 with the models' calls meeting on the pool's GPUs
RUN_FILE = "run.json"
WORKLOADS = (("azure-conv", "sharegpt"), ("azure-code", "humaneval"))  # model i takes workload i mod 2
MAX_GPUS = 64


@dataclass(frozen=True)
class SharedPoolConfig:
    """geometries, gpu (a GPU name), levels (requests per minute per model), routing ("moefied" or
    "uniform"), the pool's settings, requests read per trace, routing sizes."""

    geometries: tuple[str, ...] = ("mixtral-8x7b", "phi-3.5-moe", "llama-4-scout")
    gpu: str = "H100"
    levels: tuple[float, ...] = (0.1, 0.3, 1.0, 3.0, 10.0, 60.0)
    routing: str = "moefied"
    settings: PoolSettings = PoolSettings()
    requests: int = 30_000
    routing_prompts: int = 24
    routing_tokens: int = 32

    def command(self, out: str, extra: tuple[str, ...] = ()) -> str:
        """The `moeless eval` command line that replays this run (`extra`: more flags, before --out)."""
        s = self.settings
        args = ["moeless", "eval", "--shared-pool", "--geometry", *self.geometries, "--gpu", self.gpu,
                "--levels", *(f"{x:g}" for x in self.levels), "--routing", self.routing, "--horizon", f"{s.horizon_s:g}",
                "--idle-delay", f"{s.idle_delay_s:g}", "--keep-alive", f"{s.keep_alive_s:g}",
                "--step-ms", f"{s.step_s * 1e3:g}", "--seed", s.seed,
                *(["--keep-warm", f"{s.keep_warm:g}"] if s.keep_warm else []),
                *([] if s.family_warm else ["--no-family-warm"]), *extra, "--out", out]
        return " ".join(shlex.quote(str(a)) for a in args)


def dedicated_gpus(geometry: Geometry, gpu: GpuSpec) -> int:
    """The fewest GPUs that hold the geometry's static EP (DeploymentError if none up to MAX_GPUS does)."""
    for count in range(1, MAX_GPUS + 1):
        try:
            gpu_slots(roofline_profile(geometry, gpu, count), gpu, count, geometry.moe_layers, geometry.num_experts)
            return count
        except DeploymentError:
            continue
    raise DeploymentError(f"{geometry.name} does not fit {MAX_GPUS} x {gpu.name}")


def popularity(geometry: Geometry, routing: str, prompts: str, config: SharedPoolConfig, progress: bool) -> tuple[np.ndarray, str]:
    """([moe_layers, E] each row's share of the routed pairs, its label)."""
    e, layers = geometry.num_experts, geometry.moe_layers
    if routing == "uniform":
        return np.full((layers, e), 1.0 / e), "uniform (every expert alike)"
    # heavy (torch, the model build): kept off --help's start-up path
    from moeless.traces.recording import moefied_routing

    found = moefied_routing(e, geometry.top_k, prompts, config.routing_prompts, config.routing_tokens, progress=progress)[0]
    counts = np.stack([np.bincount(found.topk[:, l].reshape(-1), minlength=e) for l in range(found.num_layers)]).astype(float)
    shares = counts / counts.sum(axis=1, keepdims=True)
    return shares[np.arange(layers) % found.num_layers], found.label


def pool_model(geometry: Geometry, gpu: GpuSpec, shares: np.ndarray, peer_copy_s: float = PEER_COPY_S) -> PoolModel:
    """Step 1: a geometry's PoolModel on its dedicated GPU count (peer_copy_s: a copy's fixed cost, roofline.py)."""
    count = dedicated_gpus(geometry, gpu)
    profile = roofline_profile(geometry, gpu, count, peer_copy_s=peer_copy_s)
    per_byte = profile.load_s["host"] / profile.expert_bytes
    return PoolModel(geometry.name, geometry.top_k, profile.expert_bytes, profile.non_expert_bytes, count,
                     profile.load_s["host"], per_byte * profile.non_expert_bytes, profile.alpha, profile.call_overhead, shares,
                     profile.load_s["peer"])


def level_requests(found: arr.Arrivals, prompt: np.ndarray, output: np.ndarray, per_minute: float, shift: float,
                   horizon_s: float, rng: np.random.Generator) -> Requests:
    """Step 2: the arrivals thinned to per_minute requests a minute, shifted by `shift` of the trace's
    length (wrapping around; the trace repeats past its end), those within the horizon, with lengths
    cycled over the dataset's."""
    seconds, period = _period(found)
    native = len(seconds) / period * 60.0
    laps = int(np.ceil(horizon_s / period))
    times = np.concatenate([(seconds + shift * period) % period + lap * period for lap in range(laps)])
    times = np.sort(times[rng.random(len(times)) < per_minute / native])
    times = times[times < horizon_s]
    index = np.arange(len(times)) % len(prompt)
    return Requests(times, prompt[index].astype(float), output[index].astype(float))


def _period(found: arr.Arrivals) -> tuple[np.ndarray, float]:
    """(arrival seconds from the first, the trace's length: its span and one typical gap)."""
    seconds = found.seconds - found.seconds[0]
    return seconds, float(seconds[-1] + (np.median(np.diff(seconds)) if len(seconds) > 1 else 1.0))


def check_levels(levels: tuple[float, ...], found: dict[str, arr.Arrivals]) -> None:
    """DeploymentError unless every level is positive and within every trace's own rate."""
    if not levels or min(levels) <= 0:
        raise DeploymentError(f"--levels: requests per minute must be positive, got {list(levels)}")
    for trace, arrivals in found.items():
        seconds, period = _period(arrivals)
        native = len(seconds) / period * 60.0
        if max(levels) > native:
            raise DeploymentError(f"level {max(levels):g}/min is above {trace}'s own {native:.0f} requests a minute; "
                                  "thinning cannot add requests")


def evaluate_shared_pool(config: SharedPoolConfig, out: str | Path, progress: bool = True) -> dict:
    """Every level into directory `out`; returns the run document (also RUN_DIR/run.json)."""
    # 1. Inputs that can be wrong, before any work; then the models.
    gpu = gpu_spec(config.gpu)
    out, s = Path(out), replace(config.settings, gpu_bytes=MEM_FRACTION * gpu.memory)
    geometries = [load_geometry(g) for g in config.geometries]
    if config.routing not in ("moefied", "uniform"):
        raise DeploymentError(f"--routing {config.routing!r}: the shared pool takes 'moefied' or 'uniform'")
    workloads = [WORKLOADS[i % len(WORKLOADS)] for i in range(len(geometries))]
    found = {trace: arr.resolve(trace, config.requests) for trace, _ in sorted(set(workloads))}
    check_levels(config.levels, found)
    lengths = {prompts: dataset_lengths(prompts, 1000) for _, prompts in set(workloads)}
    models, labels = [], []
    for geo, (_, prompts) in zip(geometries, workloads):
        shares, label = popularity(geo, config.routing, prompts, config, progress)
        models.append(pool_model(geo, gpu, shares))
        labels.append(label)
    # 2-3. Each level: every model's requests, then the pool.
    levels = []
    for per_minute in tqdm(config.levels, desc="load levels", disable=not progress):
        rng = np.random.default_rng(s.seed)
        requests = [level_requests(found[trace], *lengths[prompts][:2], per_minute, i / len(models), s.horizon_s, rng)
                    for i, (trace, prompts) in enumerate(workloads)]
        levels.append({"requests_per_minute": per_minute, **evaluate_pool(models, requests, s)})
    run = {"format": FORMAT, "command": config.command(str(out)), "gpu": gpu.name,
           "gpu_bytes_for_weights": MEM_FRACTION * gpu.memory, "settings": asdict(s),
           "models": [{"name": m.name, "dedicated_gpus": m.gpus, "weight_gb": m.weight_bytes / 1e9,
                       "expert_mb": m.expert_bytes / 1e6, "layers": m.layers, "experts": m.experts, "top_k": m.top_k,
                       "expert_load_ms": 1e3 * m.expert_load_s, "whole_load_s": m.whole_load_s, "routing": label,
                       "workload": f"{trace} arrivals, {prompts} lengths ({lengths[prompts][2]})",
                       "arrivals": found[trace].source}
                      for m, label, (trace, prompts) in zip(models, labels, workloads)],
           "levels": levels}
    out.mkdir(parents=True, exist_ok=True)
    (out / RUN_FILE).write_text(json.dumps(run, indent=1, sort_keys=True) + "\n")
    return run
