"""One replay's figures, per phase (prefill, decode, all iterations): what run.json keeps of a TwinRecord.

Times are per MoE layer and iteration, in seconds, under both execution models (`serial`,
`paper`), each with the exposed cold starts (`_cold`) and without them (explaining, never
claimed). Costs are GB·s: the expert part under `resident` billing (memory held from load to
eviction) and `per-layer` billing (the paper's C: a layer's planned replicas for its time, that
time taken under the serial or the paper execution model, exposed cold starts included), and the
non-expert part (weights held the whole run, the same under both). Replicas per layer are
time-weighted (what the memory bill sees); churn is loads + evictions per layer and iteration.
"""

from __future__ import annotations

import numpy as np

from moeless.twin.record import EXECUTIONS, GB, TwinRecord

PHASES = ("prefill", "decode", "all")
CDF_POINTS = 101  # percentiles 0..100 of the layer time kept per phase and execution model


def phase_mask(record: TwinRecord, phase: str) -> np.ndarray:
    return np.ones(len(record.phase), dtype=bool) if phase == "all" else record.phase == phase


def figures(record: TwinRecord, expert_bytes: int, cdf: bool = False) -> dict:
    """{phase: {figure: value}} for every phase with iterations (see the module docstring);
    with cdf, each phase also keeps the layer-time percentiles 0..100 per execution model."""
    out = {}
    for phase in PHASES:
        m = phase_mask(record, phase)
        if not m.any():
            continue
        window = record.window_s[m]
        f: dict = {"iterations": int(m.sum()), "seconds": float(window.sum())}
        for execution in EXECUTIONS:
            for cold in (True, False):
                times = record.layer_time(execution, cold)[m]
                tag = f"{execution}_cold" if cold else execution
                f[f"{tag}_mean_s"] = float(times.mean())
                f[f"{tag}_p50_s"], f[f"{tag}_p99_s"] = (float(v) for v in np.percentile(times, [50, 99]))
            if cdf:
                f[f"{execution}_cold_cdf_s"] = np.percentile(record.layer_time(execution)[m], np.linspace(0, 100, CDF_POINTS)).tolist()
        share = window.sum() / record.window_s.sum() if record.window_s.sum() > 0 else 0.0
        paper_per_layer = ((record.paper_s + record.exposed_s) * record.planned)[m].sum() * expert_bytes / GB
        f.update({
            "gb_s_expert_resident": float(record.gb_s_resident[m].sum()),
            "gb_s_expert_per_layer_serial": float(record.gb_s_per_layer[m].sum()),
            "gb_s_expert_per_layer_paper": float(paper_per_layer),
            "gb_s_non_expert": float(record.non_expert_gb_s * share),
            "replicas_resident": _time_weighted(record.resident[m], window),
            "replicas_planned": float(record.planned[m].mean()),
            "replicas_resident_per_layer": _time_weighted(record.resident[m], window, per_layer=True),
            "loads": int(record.loads[m].sum()), "evictions": int(record.evictions[m].sum()),
            "loads_per_layer": float(record.loads[m].mean()),
            "churn_per_layer": float((record.loads[m] + record.evictions[m]).mean()),
            "cold_s_mean": float(record.cold_s[m].mean()), "exposed_s_mean": float(record.exposed_s[m].mean()),
            "hidden_s_mean": float(record.hidden_s[m].mean()), "exposed_s_total": float(record.exposed_s[m].sum()),
        })
        out[phase] = f
    return out


def _time_weighted(counts: np.ndarray, window: np.ndarray, per_layer: bool = False):
    """Replicas [I, L] weighted by the seconds each iteration's set is held: the mean over layers, or [L]."""
    if window.sum() <= 0:
        per = counts.mean(axis=0)
    else:
        per = (counts * window[:, None]).sum(axis=0) / window.sum()
    return per.tolist() if per_layer else float(per.mean())
