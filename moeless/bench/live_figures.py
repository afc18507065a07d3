"""`moeless bench live`'s figures (live.py, step 3 of its docstring): per configuration and phase,
the MoE-layer critical path from the planning loop's metrics and the hosts' meters, the latency
model's predictions of it (calibrated, refitted online, fitted in hindsight) and the ratios
between configurations."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np

from moeless.controller.planning.cost_fit import fit_scale

SECOND = "~2"  # the key of a configuration's second run when mirrored


def config_figures(metrics: dict, before: Sequence[dict], after: Sequence[dict], fit: dict) -> dict:
    """Per phase: the mean critical path per MoE-layer call and its parts, the latency model's
    prediction and its error; the hosts' GB·s, loads and cold starts over the run (meters after -
    before). fit: hardware/host_profile.fit_costs's host_s, c0, beta (seconds)."""
    delta = {k: sum(a[k] - b[k] for a, b in zip(after, before))
             for k in ("gb_s", "loads", "cold_starts", "cold_exposed_s", "cold_hidden_s", "evictions")}
    phases = metrics["stats"]["phases"]
    client_cold = sum(sum(p["sum_cold_starts"]) for p in phases.values())
    out: dict[str, Any] = {"hosts_delta": delta, "expert_gb_s": delta["gb_s"],
                           "resident_replicas_end": metrics["resident_replicas"],
                           "planner": {k: metrics[k] for k in ("passes", "plans", "publishes", "loads_sent", "errors")},
                           "plan_s_mean": metrics["plan_s"]["sum"] / max(metrics["plans"], 1),
                           "latency_fit_end": metrics["latency_fit"], "phases": {}}
    for phase, p in phases.items():
        calls = np.asarray(p["calls_per_layer"], dtype=np.float64)
        if calls.sum() == 0:
            continue
        share = sum(p["sum_cold_starts"]) / client_cold if client_cold else 0.0
        exposed = delta["cold_exposed_s"] * share  # the hosts' waits, shared out by the calls' cold starts
        sums = {k: np.asarray(p[f"sum_{k}"]) for k in ("compute_s", "host_tokens", "model_s", "wall_s")}
        move = fit["c0"] * calls + 2 * fit["beta"] * sums["host_tokens"]  # per layer [L]
        model = sums["model_s"] + fit["host_s"] * calls  # + a host call's fixed compute
        online = np.asarray(p["sum_model_online_s"])  # refitted in-run, each call predicted before it was seen
        with np.errstate(invalid="ignore", divide="ignore"):
            per_layer = (sums["compute_s"] + move) / calls + exposed / calls.sum()
        n = calls.sum()
        measured = float((sums["compute_s"].sum() + move.sum() + exposed) / n)
        predicted = float((model.sum() + move.sum() + exposed) / n)
        predicted_online = float((online.sum() + move.sum() + exposed) / n)
        out["phases"][phase] = {
            "iterations": p["iterations"], "layer_calls": int(n), "critical_path_s": measured,
            "compute_s": float(sums["compute_s"].sum() / n), "transfer_s": float(move.sum() / n),
            "exposed_wait_s": exposed / n, "host_tokens": float(sums["host_tokens"].sum() / n),
            "wall_s": float(sums["wall_s"].sum() / n), "model_s": predicted, "model_error": predicted / measured - 1.0,
            "model_compute_error": float(model.sum() / sums["compute_s"].sum() - 1.0),
            "model_online_s": predicted_online, "model_online_error": predicted_online / measured - 1.0,
            "critical_path_per_layer_s": np.nan_to_num(per_layer).tolist(),
            "forecast_s_per_iteration": p["forecast_s"] / max(p["iterations"], 1),
            "sums": {"calls": calls.tolist(), "compute_s": sums["compute_s"].tolist(), "model_compute_s": model.tolist(),
                     "transfer_and_waits_s": float(move.sum() + exposed)},
        }
    return out


def fit_in_run(phases: dict) -> tuple[float, float]:
    """(a, b) with a layer call's measured compute ~ a x the idle-calibrated model's + b seconds,
    least squares over a configuration's per-layer sums of both phases (static EP's: the machine
    as loaded during the run; the model's shape stays the calibration's). Hindsight, unlike the
    loop's causal refit (model_online_*): it explains, it is not a claim."""
    def column(key):
        return [v for p in phases.values() for v in p["sums"][key]]

    return fit_scale(np.array(column("model_compute_s")), np.array(column("calls")), np.array(column("compute_s")))


def add_in_run_model(results: dict, a: float, b: float) -> None:
    """Each configuration's critical path as the model calibrated in-run (fit_in_run) predicts it."""
    for r in results.values():
        for p in r["phases"].values():
            s, n = p["sums"], p["layer_calls"]
            predicted = (a * sum(s["model_compute_s"]) + b * sum(s["calls"]) + s["transfer_and_waits_s"]) / n
            p["model_in_run_s"], p["model_in_run_error"] = predicted, predicted / p["critical_path_s"] - 1.0


def config_name(key: str) -> str:
    """The configuration a run's key names ("moeless~2": moeless's second, mirrored run)."""
    return key.removesuffix(SECOND)


def ratios(results: dict, bases: Sequence[str] = ("static",)) -> dict:
    """Each configuration's mean critical path per phase (over its runs: NAME, and NAME~2 when
    mirrored) over the mean of the `bases`' runs (static EP; with "static-again" too, the bracket
    of the run, which halves a linear drift)."""
    paths: dict[str, dict[str, list[float]]] = {}
    for key, r in results.items():
        for phase, p in r["phases"].items():
            paths.setdefault(config_name(key), {}).setdefault(phase, []).append(p["critical_path_s"])
    if not all(b in paths for b in bases):
        return {}
    base = {phase: np.mean([v for b in bases for v in paths[b][phase]]) for phase in paths[bases[0]]
            if all(phase in paths[b] for b in bases)}
    return {name: {phase: float(np.mean(v)) / base[phase] for phase, v in by_phase.items() if phase in base}
            for name, by_phase in paths.items()}
