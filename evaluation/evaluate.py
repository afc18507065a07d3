"""`moeless eval`, the run: workloads -> iterations, loads and forecasts -> every case through the
twin -> RUN_DIR/run.json (everything the report needs) and RUN_DIR/cost-profile.json.

Inputs are checked before any work (traces row by row, the cost profile's fields, the planner's
name, the knobs), so a bad one costs one error line, not a traced model.
"""

from __future__ import annotations

import json
import shlex
from dataclasses import asdict, dataclass
from pathlib import Path

from tqdm import tqdm

from moeless.controller.knobs import Knobs
from moeless.controller.planning.rules import memory_price
from moeless.core.paths import cache_dir
from moeless.evaluation import runs
from moeless.evaluation.workload import Sizes, WorkloadSpec, prepare, read_arrivals
from moeless.hardware.cpu_profile import measure_profile
from moeless.placement.cluster import Cluster, ClusterError
from moeless.placement.fill_placer import HORIZON
from moeless.placement.planner import PlannerConfig
from moeless.placement.profile import CostProfile, ProfileError
from moeless.twin.batching import BATCHING
from moeless.twin.twin import TwinSettings

FORMAT = "moeless-eval/1"
RUN_FILE = "run.json"
PROFILE_FILE = "cost-profile.json"


@dataclass(frozen=True)
class EvalConfig:
    """Everything one run depends on (see `moeless eval --help` for each)."""

    workloads: tuple[WorkloadSpec, ...]
    knobs: Knobs = Knobs()
    sizes: Sizes = Sizes()
    model: str = "default"
    batchings: tuple[str, ...] = BATCHING
    gpus: int = 8
    tier: str = "host"
    profile: str | None = None
    ablations: tuple[tuple[str, ...], ...] = ()
    distances: tuple[int, ...] = runs.DISTANCES
    cv_thresholds: tuple[float, ...] = runs.CV_THRESHOLDS
    quick: bool = False

    def command(self, out: str, profile: str | None) -> str:
        """The `moeless eval` command line that replays this run with `profile` (every setting spelled out)."""
        k, s = self.knobs, self.sizes
        args = ["moeless", "eval", "--model", self.model]
        for w in self.workloads:
            args += ["--workload", f"{w.name}={w.trace or 'generated'}:{w.prompts}"]
        args += ["--requests", s.requests, "--prompt-count", s.prompts, "--new-tokens", s.new_tokens,
                 "--time-scale", s.time_scale, "--rate", f"{s.rate:.4g}", "--burstiness", s.cv, "--seed", s.seed,
                 "--batching", *self.batchings, "--step-ms", f"{s.step_s * 1e3:g}", "--max-batch", s.max_batch,
                 "--max-iterations", s.max_iterations, "--gpus", self.gpus, "--tier", self.tier,
                 "--planner", k.planner, "--predictor", k.predictor, "--distance", k.distance, "--keep-alive", k.keep_alive_s,
                 "--cv-threshold", k.cv_threshold]
        if k.layer_memory_cap_gib is not None:
            args += ["--layer-memory-cap", k.layer_memory_cap_gib]
        args += [*(["--no-scaler"] if not k.scaler else []), *(["--no-placer"] if not k.placer else [])]
        args += ["--ablate", *([",".join(a) for a in self.ablations] or ["none"])]
        args += ["--sweep-distances", *(self.distances or ["none"]), "--sweep-cv", *(self.cv_thresholds or ["none"])]
        args += [*(["--profile", profile] if profile else []), "--out", out]
        return " ".join(shlex.quote(str(a)) for a in args)


def read_profile(path: str) -> CostProfile:
    """A cost profile JSON (placement/profile.py), or a benchmark's JSON holding one under "cost_profile"."""
    try:
        doc = json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise ProfileError(f"{path}: no such cost profile; write one with `moeless bench planner --out DIR`") from None
    except (OSError, json.JSONDecodeError) as err:
        raise ProfileError(f"{path}: not a readable JSON cost profile ({err})") from None
    if isinstance(doc, dict) and isinstance(doc.get("cost_profile"), dict):
        doc = doc["cost_profile"]
    return CostProfile.from_mapping(doc, str(path))


def evaluate(config: EvalConfig, out: str | Path, progress: bool = True) -> dict:
    """Run the evaluation into directory `out` and return the run document (also RUN_DIR/run.json)."""
    out = Path(out)
    # 1. Inputs that can be wrong, before any work: the profile, the traces, the ablations.
    profile = read_profile(config.profile) if config.profile else None
    arrivals = [read_arrivals(w, config.sizes) for w in config.workloads]
    for ablation in config.ablations:
        runs.ablated(config.knobs.planner, "scaler" not in ablation, "placer" not in ablation)
    # 2. Real loads and forecasts of every workload (traced once, cached by model and predictor).
    # Always the forecasts at 1..5 (and the knob's d): one cache entry serves every sweep and ablation choice.
    traced = sorted({config.knobs.distance, *runs.DISTANCES, *config.distances})
    workloads = [prepare(w, a, config.model, config.sizes, traced, config.batchings) for w, a in zip(config.workloads, arrivals)]
    first = next(iter(workloads[0].batchings.values())).iterations[0].load
    num_layers, num_experts = first.shape
    config.knobs.check_for_model(num_layers)
    if profile is None:
        profile = _measure(workloads[0].facts, config.quick, num_experts, config.gpus)
    cluster, cap = _cluster(config, profile, num_layers, num_experts)
    price = memory_price(config.knobs, profile, num_layers, num_experts)
    planner_config = PlannerConfig(model=profile.latency_model(config.tier), cv_threshold=config.knobs.cv_threshold,
                                   horizon=HORIZON, keep_alive_s=config.knobs.keep_alive_s, gb_s_price=price,
                                   iteration_s=config.sizes.step_s, home_moves_every=config.knobs.home_moves_every)
    settings = TwinSettings(keep_alive_s=config.knobs.keep_alive_s, tier=config.tier)
    # 3. Every case through the twin; ablations and sweeps under the first batching only.
    plans = {(w.spec.name, mode): runs.plan_cases(config.knobs, *((config.ablations, config.distances, config.cv_thresholds)
                                                                  if i == 0 else ((), (), ())), num_layers)
             for w in workloads for i, mode in enumerate(config.batchings)}
    total = sum(len({c.key for c in plans[(w.spec.name, mode)]}) * len(b.iterations) for w in workloads for mode, b in w.batchings.items())
    docs = []
    with tqdm(total=total, desc="replaying planners", unit="it", disable=not progress) as bar:
        for w in workloads:
            batchings = {}
            for mode, batched in w.batchings.items():
                its = batched.iterations
                rows = runs.execute(plans[(w.spec.name, mode)], its, batched.forecasts, cluster, profile, planner_config,
                                    settings, bar)
                batchings[mode] = {"iterations": len(its), "prefill_iterations": sum(it.phase == "prefill" for it in its),
                                   "accuracy": batched.accuracy, "cases": rows}
            docs.append({"name": w.spec.name, "trace": w.spec.trace or "generated", "prompts": w.spec.prompts,
                         "arrivals": w.arrivals.source, "requests": len(w.arrivals.seconds), "loads": _portable(w.loads_note),
                         "batchings": batchings})
    out.mkdir(parents=True, exist_ok=True)
    profile_path = profile.to_json(out / PROFILE_FILE)
    doc = {
        "format": FORMAT,
        "command": config.command(str(out), str(profile_path)),
        "quick": config.quick,
        "profile": asdict(profile),
        "model": {"source": config.model, "layers": num_layers, "experts": num_experts, "top_k": workloads[0].top_k},
        "cluster": {"gpus": config.gpus, "layer_cap_replicas": cap, "slots_per_gpu": int(cluster.slots()[0]),
                    "expert_bytes": profile.expert_bytes, "tier": config.tier, "cold_start_s": profile.load_s[config.tier]},
        "knobs": config.knobs.to_mapping(),
        "planner": {"horizon": HORIZON, "gb_s_price": planner_config.gb_s_price, "iteration_s": config.sizes.step_s},
        "sizes": asdict(config.sizes), "batchings": list(config.batchings),
        "ablations": [list(a) for a in config.ablations], "distances": list(config.distances),
        "cv_thresholds": list(config.cv_thresholds),
        "workloads": docs,
    }
    (out / RUN_FILE).write_text(json.dumps(doc, indent=1, sort_keys=True) + "\n")
    return doc


def _measure(facts, quick: bool, num_experts: int, num_gpus: int) -> CostProfile:
    """The cost profile measured now on this machine at the model's expert shape (as `moeless bench planner`)."""
    return measure_profile(facts.hidden, facts.ffn, facts.non_expert_bytes, 10 if quick else 60, num_experts=num_experts,
                           num_gpus=num_gpus)[0]


def _cluster(config: EvalConfig, profile: CostProfile, num_layers: int, num_experts: int):
    """G GPUs holding every layer at its cap (the layer memory cap knob, else 2 x one replica per expert)."""
    gib = config.knobs.layer_memory_cap_gib
    cap = 2 * num_experts if gib is None else int(gib * 2**30 // profile.expert_bytes)
    if cap < num_experts:
        raise ClusterError(f"layerMemoryCapGiB: {gib} GiB holds {cap} replicas of {profile.expert_bytes} bytes, fewer than "
                           f"the {num_experts} experts of a layer; raise it to at least {num_experts * profile.expert_bytes / 2**30:.4f}")
    return Cluster.uniform(config.gpus, -(-num_layers * cap // config.gpus), profile.expert_bytes, cap), cap


def _portable(note: str) -> str:
    """A note without this machine's cache path (reports are checked in)."""
    return note.replace(str(cache_dir()), "<moeless cache>")
