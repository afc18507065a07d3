"""What `moeless eval` replays: the comparison, the ablations and the two sweeps, as cases of the twin.

A case is one planner fed one forecast kind at one prediction distance d (cold loads start d layers
ahead), in one of four groups:
1. main: the system under test (the knobs: planner, predictor, scaler, placer), moeless with the
   predictor and with a perfect forecast (the gap is the predictor's worth), the paper's planner,
   static EP (Megatron-LM), EPLB as DeepSeek runs it (every 10 iterations from the last 10
   iterations' loads) and EPLB every iteration on the predictor's forecast (both at moeless's
   replica budget), and the Oracle (lossy: a bound).
2. ablation: the system's planner family (moeless or paper) with parts switched off, by name:
   predictor off = the history window, scaler off = one replica per expert, placer off = static
   (round-robin) placement of its replicas; any combination.
3. distance: the system's planner with the predictor at d = 1..5 (the paper's figures 13-14).
4. cv: the paper's planner at CV threshold V = 0.2..1.0 (figures 15-17; moeless's planner has no
   CV threshold: it adds a replica where its priced gain pays).
Cases that replay the same thing (the same planner, forecast, d and, for the paper family, V) run once.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from itertools import combinations
from typing import Sequence

from moeless.twin.compare import Run, run_all
from moeless.placement.planner import PlannerConfig
from moeless.twin.twin import TwinSettings
from moeless.evaluation.figures import figures
from moeless.controller.knobs import Knobs

PARTS = ("predictor", "scaler", "placer")
FAMILIES = ("moeless", "paper")  # planners with switchable parts
DISTANCES = (1, 2, 3, 4, 5)
CV_THRESHOLDS = (0.2, 0.4, 0.6, 0.8, 1.0)
BASELINES = (  # (planner, forecast, label)
    ("paper", "predictor", "paper's planner (CV <= V, JSQ)"),
    ("static", "perfect", "static EP (Megatron-LM)"),
    ("eplb-window", "previous", "EPLB (every 10 iterations, past loads)"),
    ("eplb", "predictor", "EPLB (every iteration, predictor)"),
    ("oracle", "perfect", "Oracle (lossy bound)"),
)


class CaseError(ValueError):
    """An ablation or sweep that cannot be run (the message names the flag)."""


@dataclass(frozen=True)
class Case:
    """One replay: group (main, ablation, distance, cv), label (words for reports), planner (a name),
    forecast (perfect, previous, predictor, history), distance d, cv_threshold (paper family only),
    parts_off (ablations: the parts switched off)."""

    group: str
    label: str
    planner: str
    forecast: str
    distance: int
    cv_threshold: float | None = None
    parts_off: tuple[str, ...] = ()

    @property
    def key(self) -> tuple:
        return self.planner, self.forecast, self.distance, self.cv_threshold


def ablated(base: str, scaler: bool = True, placer: bool = True) -> str:
    """The planner name of `base` (moeless or paper) with its scaler and/or placer off."""
    if base not in FAMILIES:
        raise CaseError(f"--no-scaler, --no-placer and --ablate need planner {' or '.join(FAMILIES)}; got {base!r}")
    suffix = ("" if scaler else "-no-scaler") + ("" if placer else "-no-placer")
    return base + suffix


def parse_ablations(specs: Sequence[str]) -> list[tuple[str, ...]]:
    """`--ablate` values -> the sets of parts to switch off, each sorted as PARTS. A value is a part,
    parts joined by ',' or '+', "all" (every combination) or "none"."""
    out: list[tuple[str, ...]] = []
    for spec in specs:
        if spec == "none":
            continue
        if spec == "all":
            out += [c for n in range(1, len(PARTS) + 1) for c in combinations(PARTS, n)]
            continue
        parts = [p.strip() for p in spec.replace("+", ",").split(",") if p.strip()]
        unknown = [p for p in parts if p not in PARTS]
        if unknown or not parts:
            raise CaseError(f"--ablate {spec!r}: unknown part {unknown[0] if unknown else spec!r}; use {', '.join(PARTS)}, "
                            "combinations like scaler,placer, all or none")
        out.append(tuple(p for p in PARTS if p in parts))
    return list(dict.fromkeys(out))


def forecast_of(predictor: str) -> str:
    """The knob `predictor` as a forecast kind: gate -> predictor; history or off -> the history window."""
    return "predictor" if predictor == "gate" else "history"


def system_case(knobs: Knobs) -> Case:
    """The system under test, from the serving knobs."""
    name = knobs.planner
    if not (knobs.scaler and knobs.placer):
        name = ablated(knobs.planner, knobs.scaler, knobs.placer)
    off = tuple(p for p, on in zip(PARTS, (knobs.predictor == "gate", knobs.scaler, knobs.placer)) if not on)
    label = name if knobs.predictor == "gate" else f"{name}, history window"
    return _case("main", label, name, forecast_of(knobs.predictor), knobs.distance, knobs.cv_threshold, off)


def plan_cases(knobs: Knobs, ablations: Sequence[tuple[str, ...]] = (), distances: Sequence[int] = (),
               cv_thresholds: Sequence[float] = (), num_layers: int | None = None) -> list[Case]:
    """Every case of one batching of one workload, main ones first (EPLB's budget is moeless's memory)."""
    d, v = knobs.distance, knobs.cv_threshold
    system = system_case(knobs)
    cases = [system,
             _case("main", "moeless", "moeless", "predictor", d, v),
             _case("main", "moeless, perfect forecast", "moeless", "perfect", d, v)]
    cases += [_case("main", label, planner, forecast, d, v) for planner, forecast, label in BASELINES]
    cases = list({c.key: c for c in reversed(cases)}.values())[::-1]  # the system's label wins over a baseline's
    if ablations:
        base = knobs.planner
        ablated(base)  # the family must have switchable parts
        cases.append(_case("ablation", f"{base} (all parts on)", base, "predictor", d, v))
        for off in ablations:
            name = ablated(base, "scaler" not in off, "placer" not in off)
            label = f"{base} " + " ".join(f"-{p}" for p in off)
            cases.append(_case("ablation", label, name, "history" if "predictor" in off else "predictor", d, v, off))
    reach = [x for x in distances if num_layers is None or x < num_layers]
    cases += [_case("distance", f"{system.planner}, d={x}", system.planner, "predictor", x, v) for x in reach]
    cases += [_case("cv", f"paper's planner, V={x:g}", "paper", "predictor", d, x) for x in cv_thresholds]
    return cases


def _case(group, label, planner, forecast, distance, cv, off=()) -> Case:
    return Case(group, label, planner, forecast, distance, cv if planner.startswith("paper") else None, tuple(off))


def execute(cases: Sequence[Case], iterations, forecasts: dict, cluster, profile, config: PlannerConfig,
            settings: TwinSettings, progress=None) -> list[dict]:
    """Replay every distinct case through the twin (twin/compare.run_all: EPLB at the
    replica budget moeless holds in the same condition) and return one dict per case: its fields
    and its figures (main cases keep their layer-time CDFs)."""
    records: dict[tuple, object] = {}
    # Cases with the same CV threshold replay together, those without one first and in order (EPLB
    # needs moeless's record from the same call).
    pending = sorted({c.key: c for c in cases}.values(), key=lambda c: (c.cv_threshold is not None, c.cv_threshold or 0.0))
    while pending:
        cv = pending[0].cv_threshold
        batch = []
        while pending and pending[0].cv_threshold == cv:
            batch.append(pending.pop(0))
        knobs = config if cv is None else replace(config, cv_threshold=cv)
        done = run_all([Run(c.planner, c.forecast, c.distance) for c in batch], iterations, forecasts, cluster, profile,
                       knobs, settings, progress)
        for c in batch:
            records[c.key] = done[Run(c.planner, c.forecast, c.distance)]
    out = []
    for c in cases:
        row = {"group": c.group, "label": c.label, "planner": c.planner, "forecast": c.forecast, "distance": c.distance,
               "cv_threshold": c.cv_threshold, "parts_off": list(c.parts_off)}
        row["figures"] = figures(records[c.key], cluster.expert_bytes, cdf=c.group == "main")
        out.append(row)
    return out
