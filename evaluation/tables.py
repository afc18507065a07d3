"""The report's tables, built from a run document (run.json): pure, so the same run gives the same tables.

Every table says in its caption which execution model (serial, paper), billing model (resident,
per-layer), forecast and cold-start accounting its numbers are under; times are microseconds per
MoE layer and iteration, costs GB·s. Rows keep raw values (CSV, JSON); `formats` say how the
markdown shows each column.
"""

from __future__ import annotations

from dataclasses import dataclass, field

US = 1e6
PAPER_CLAIMS = (  # (claim, the paper's figure, our planner compared, baseline planner, kind)
    ("mean MoE-layer time vs static EP (Megatron-LM)", -0.43, "static", "time"),
    ("mean MoE-layer time vs EPLB", -0.22, "eplb-window", "time"),
    ("cost vs the Oracle", -0.84, "oracle", "cost"),
)
COLD = "exposed cold starts included (loads started d layers ahead; only the part a layer waited for)"


@dataclass
class Table:
    """name: file stem; title; caption: the labels; columns; formats (per column: '' text, 'us',
    'x' ratio, 'pct' change, 'gbs' 4 significant digits, 'd' integer, '.Nf'); rows: raw values."""

    name: str
    title: str
    caption: str
    columns: list[str]
    formats: list[str]
    rows: list[list] = field(default_factory=list)


def forecast_label(kind: str, distance: int | None) -> str:
    return {"perfect": "perfect", "previous": "previous iteration", "history": "history window (16 iterations)",
            "predictor": f"gate replicas, d={distance}"}.get(kind, kind)


def main_cases(batching: dict) -> list[dict]:
    return [c for c in batching["cases"] if c["group"] == "main"]


def find(cases: list[dict], planner: str, forecast: str | None = None) -> dict | None:
    """The first case of `planner` (fed `forecast`, when given)."""
    return next((c for c in cases if c["planner"] == planner and forecast in (None, c["forecast"])), None)


def ratio(a: float | None, b: float | None) -> float | None:
    return a / b if a is not None and b not in (None, 0) else None


def _get(case: dict, phase: str, key: str):
    return case["figures"].get(phase, {}).get(key)


def time_table(name: str, workload: str, batching_name: str, batching: dict, execution: str) -> Table:
    cases = main_cases(batching)
    static = find(cases, "static")
    cols = ["planner", "forecast"]
    fmts = ["", ""]
    for phase in ("prefill", "decode"):
        cols += [f"{phase} mean", f"{phase} p50", f"{phase} p99"]
        fmts += ["us"] * 3
    cols += ["all mean", "all vs static EP", f"all mean, {execution} without cold starts"]
    fmts += ["us", "x", "us"]
    table = Table(name, f"{workload}: MoE-layer time, {execution} execution ({batching_name} batching)",
                  f"Microseconds per MoE layer and iteration, {execution} execution model, {COLD}; the last column leaves "
                  f"the cold starts out (to explain, not to claim).", cols, fmts)
    for c in cases:
        row = [c["label"], forecast_label(c["forecast"], c["distance"])]
        for phase in ("prefill", "decode"):
            row += [_us(_get(c, phase, f"{execution}_cold_{s}_s")) for s in ("mean", "p50", "p99")]
        mean = _get(c, "all", f"{execution}_cold_mean_s")
        row += [_us(mean), ratio(mean, _get(static, "all", f"{execution}_cold_mean_s") if static else None),
                _us(_get(c, "all", f"{execution}_mean_s"))]
        table.rows.append(row)
    return table


def cost_table(name: str, workload: str, batching_name: str, batching: dict) -> Table:
    cases = main_cases(batching)
    static, oracle = find(cases, "static"), find(cases, "oracle")
    table = Table(name, f"{workload}: cost in GB·s ({batching_name} batching)",
                  "GB·s over the whole run (all iterations). Expert part under `resident` billing (memory held from "
                  "load to eviction) and `per-layer` billing (the paper's C: a layer's planned replicas for its time, "
                  "that time under the serial or the paper execution model, exposed cold starts included); the "
                  "non-expert weights are held all run under both. Totals = expert + non-expert.",
                  ["planner", "forecast", "expert, resident", "expert, per-layer (serial)", "expert, per-layer (paper)",
                   "non-expert", "total, resident", "total, per-layer (serial)", "total resident vs static EP",
                   "total resident vs Oracle", "total per-layer (serial) vs Oracle"],
                  ["", "", "gbs", "gbs", "gbs", "gbs", "gbs", "gbs", "x", "x", "x"])

    def totals(c):
        non = _get(c, "all", "gb_s_non_expert")
        return _get(c, "all", "gb_s_expert_resident") + non, _get(c, "all", "gb_s_expert_per_layer_serial") + non

    for c in cases:
        res, per = totals(c)
        table.rows.append([c["label"], forecast_label(c["forecast"], c["distance"]), _get(c, "all", "gb_s_expert_resident"),
                           _get(c, "all", "gb_s_expert_per_layer_serial"), _get(c, "all", "gb_s_expert_per_layer_paper"),
                           _get(c, "all", "gb_s_non_expert"), res, per, ratio(res, totals(static)[0] if static else None),
                           ratio(res, totals(oracle)[0] if oracle else None), ratio(per, totals(oracle)[1] if oracle else None)])
    return table


def replicas_table(name: str, workload: str, batching_name: str, batching: dict) -> Table:
    table = Table(name, f"{workload}: replicas, cold starts and churn ({batching_name} batching)",
                  "Per MoE layer: replicas resident (time-weighted: what resident billing pays for) and planned (used "
                  "by the plan); loads and evictions over the run; churn = (loads + evictions) per layer and iteration; "
                  "cold-start time per layer and iteration (the GPU that loads the most), the part exposed after "
                  "prefetch at distance d and the part hidden, in microseconds.",
                  ["planner", "forecast", "resident, prefill", "resident, decode", "planned", "loads", "evictions",
                   "churn", "cold start", "exposed", "hidden"],
                  ["", "", ".2f", ".2f", ".2f", "d", "d", ".3f", "us", "us", "us"])
    for c in main_cases(batching):
        table.rows.append([c["label"], forecast_label(c["forecast"], c["distance"]), _get(c, "prefill", "replicas_resident"),
                           _get(c, "decode", "replicas_resident"), _get(c, "all", "replicas_planned"), _get(c, "all", "loads"),
                           _get(c, "all", "evictions"), _get(c, "all", "churn_per_layer"), _us(_get(c, "all", "cold_s_mean")),
                           _us(_get(c, "all", "exposed_s_mean")), _us(_get(c, "all", "hidden_s_mean"))])
    return table


def ablation_table(name: str, workload: str, batching: dict) -> Table | None:
    cases = [c for c in batching["cases"] if c["group"] == "ablation"]
    if not cases:
        return None
    full = next(c for c in cases if not c["parts_off"])
    table = Table(name, f"{workload}: ablations",
                  "Parts switched off: predictor = the history window instead of the gate replicas; scaler = one replica "
                  "per expert; placer = static (round-robin) placement of its replicas. Microseconds per MoE layer, "
                  f"{COLD}; expert GB·s under resident billing.",
                  ["ablation", "planner", "forecast", "prefill, serial", "decode, serial", "all, serial", "all, serial vs all on",
                   "all, paper", "expert GB·s, resident", "replicas resident"],
                  ["", "", "", "us", "us", "us", "x", "us", "gbs", ".2f"])
    for c in cases:
        mean = _get(c, "all", "serial_cold_mean_s")
        table.rows.append([c["label"], c["planner"], forecast_label(c["forecast"], c["distance"]),
                           _us(_get(c, "prefill", "serial_cold_mean_s")), _us(_get(c, "decode", "serial_cold_mean_s")), _us(mean),
                           ratio(mean, _get(full, "all", "serial_cold_mean_s")), _us(_get(c, "all", "paper_cold_mean_s")),
                           _get(c, "all", "gb_s_expert_resident"), _get(c, "all", "replicas_resident")])
    return table


def distance_table(name: str, workload: str, batching: dict) -> Table | None:
    cases = [c for c in batching["cases"] if c["group"] == "distance"]
    if not cases:
        return None
    static = find(main_cases(batching), "static")
    accuracy = {row["distance"]: row["all"] for row in batching["accuracy"] if row["forecast"] == "predictor"}
    table = Table(name, f"{workload}: prediction distance sweep ({cases[0]['planner']})",
                  "The planner fed the gate-replica predictor at distance d (its cold loads start d layers ahead). Load "
                  "accuracy of the forecasts during the run; microseconds per MoE layer over all iterations, " + COLD + "; "
                  "expert GB·s under resident billing.",
                  ["d", "predictor load accuracy", "serial", "serial vs static EP", "paper", "exposed cold start", "loads",
                   "expert GB·s, resident", "replicas resident"],
                  ["d", ".3f", "us", "x", "us", "us", "d", "gbs", ".2f"])
    for c in cases:
        mean = _get(c, "all", "serial_cold_mean_s")
        table.rows.append([c["distance"], accuracy.get(c["distance"]), _us(mean),
                           ratio(mean, _get(static, "all", "serial_cold_mean_s") if static else None),
                           _us(_get(c, "all", "paper_cold_mean_s")), _us(_get(c, "all", "exposed_s_mean")),
                           _get(c, "all", "loads"), _get(c, "all", "gb_s_expert_resident"), _get(c, "all", "replicas_resident")])
    return table


def cv_table(name: str, workload: str, batching: dict) -> Table | None:
    cases = [c for c in batching["cases"] if c["group"] == "cv"]
    if not cases:
        return None
    table = Table(name, f"{workload}: CV threshold sweep (the paper's planner)",
                  "The paper's planner (scale while the CV of per-replica loads exceeds V, JSQ placement) fed the "
                  f"gate-replica predictor; microseconds per MoE layer, {COLD}; expert GB·s under resident billing. "
                  "moeless's own planner has no CV threshold (it adds a replica where its priced gain pays).",
                  ["V", "prefill, serial", "decode, serial", "all, serial", "all, paper", "replicas resident", "loads",
                   "expert GB·s, resident"],
                  [".1f", "us", "us", "us", "us", ".2f", "d", "gbs"])
    for c in cases:
        table.rows.append([c["cv_threshold"], _us(_get(c, "prefill", "serial_cold_mean_s")), _us(_get(c, "decode", "serial_cold_mean_s")),
                           _us(_get(c, "all", "serial_cold_mean_s")), _us(_get(c, "all", "paper_cold_mean_s")),
                           _get(c, "all", "replicas_resident"), _get(c, "all", "loads"), _get(c, "all", "gb_s_expert_resident")])
    return table


def accuracy_table(name: str, workload: str, batching: dict) -> Table:
    table = Table(name, f"{workload}: forecast accuracy during the run",
                  "Load accuracy (1 - half the L1 distance between forecast and actual load shares, 1 = exact) of each "
                  "forecast over the replayed iterations, per layer, averaged.",
                  ["forecast", "prefill", "decode", "all"], ["", ".3f", ".3f", ".3f"])
    for row in batching["accuracy"]:
        table.rows.append([forecast_label(row["forecast"], row["distance"]), row["prefill"], row["decode"], row["all"]])
    return table


def claims_table(doc: dict) -> Table:
    """moeless against the paper's three headline claims, per workload, under every model."""
    table = Table("claims", "moeless against the paper's claims",
                  "Change of moeless (gate-replica predictor at the configured d) against the baseline, over all "
                  "iterations of the first batching. Times: mean MoE-layer time; 'with cold starts' counts the exposed "
                  "part after prefetch, 'without' leaves it out (explaining only). Cost: total GB·s (expert + non-expert) "
                  "and the expert part alone.",
                  ["workload", "claim", "paper", "ours", "execution", "billing", "cold starts"],
                  ["", "", "pct", "pct", "", "", ""])
    for w in doc["workloads"]:
        batching = w["batchings"][doc["batchings"][0]]
        cases = main_cases(batching)
        ours = find(cases, "moeless", "predictor")
        for claim, paper, baseline, kind in PAPER_CLAIMS:
            base = find(cases, baseline)
            if ours is None or base is None:
                continue
            if kind == "time":
                for execution in ("serial", "paper"):
                    for cold in (True, False):
                        key = f"{execution}_cold_mean_s" if cold else f"{execution}_mean_s"
                        table.rows.append([w["name"], claim, paper, _change(_get(ours, "all", key), _get(base, "all", key)),
                                           execution, "-", "with" if cold else "without"])
                continue
            for billing, key in (("resident", "gb_s_expert_resident"), ("per-layer (serial)", "gb_s_expert_per_layer_serial"),
                                 ("per-layer (paper)", "gb_s_expert_per_layer_paper")):
                non = (_get(ours, "all", "gb_s_non_expert"), _get(base, "all", "gb_s_non_expert"))
                execution = billing.split("(")[-1].rstrip(")") if "(" in billing else "-"
                table.rows.append([w["name"], claim + ", total", paper,
                                   _change(_get(ours, "all", key) + non[0], _get(base, "all", key) + non[1]),
                                   execution, billing.split(" (")[0], "with"])
                table.rows.append([w["name"], claim + ", expert part", paper, _change(_get(ours, "all", key), _get(base, "all", key)),
                                   execution, billing.split(" (")[0], "with"])
    return table


def _change(ours: float | None, base: float | None) -> float | None:
    r = ratio(ours, base)
    return None if r is None else r - 1.0


def _us(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * US
