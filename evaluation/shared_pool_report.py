"""Render a `moeless eval --shared-pool` run (shared_pool_run.py): report.md, shared-pool.csv,
report.json and gpu-seconds.png, the same bytes from the same run.json; a fine-tunes' run in
RUN_DIR/finetunes (finetune_report.py) becomes the report's last section."""

from __future__ import annotations

import json
from pathlib import Path

from moeless.evaluation import finetune_report
from moeless.evaluation.plots import _figure as figure, _save
from moeless.evaluation.report import load_run, notes_section, rows_csv, write_markdown, write_text
from moeless.evaluation.shared_pool_run import FORMAT
from moeless.twin.shared_pool import WAYS

TARGET_RATIO = 0.6  # expert-grain GPU-seconds / dedicated, where models sit idle half the time or more
TARGET_P99 = 1.1  # each model's p99 MoE time per step outside wake-ups / its dedicated pool's


def render(run_dir: str | Path, markdown: str | Path | None = None) -> list[Path]:
    """Write the report into run_dir (and the markdown also to `markdown`); returns the files written."""
    run_dir = Path(run_dir)
    run = load_run(run_dir, FORMAT)
    table = rows(run)
    checks = acceptance(run)
    written = [write_text(run_dir / "shared-pool.csv", rows_csv(table)),
               write_text(run_dir / "report.json", json.dumps({"format": "moeless-shared-pool-report/1", "command": run["command"],
                                                            "rows": table, "acceptance": checks}, indent=1, sort_keys=True) + "\n"),
               _plot(run, run_dir / "gpu-seconds.png")]
    body = (_markdown(run, checks) + notes_section(run_dir)
            + finetune_report.section(run_dir / finetune_report.SUBDIR, f"RUN/{finetune_report.SUBDIR}"))
    return write_markdown(run_dir, body, markdown) + written


def rows(run: dict) -> list[dict]:
    """One row per (level, model): idle share, GB·s each way, wake-ups, cold starts outside them."""
    out = []
    for level in run["levels"]:
        for m in level["models"]:
            out.append({"requests_per_minute": level["requests_per_minute"], "model": m["model"], "requests": m["requests"],
                        "idle_fraction": m["idle_fraction"], **{f"gb_s_{w}": m["gb_s"][w] for w in WAYS},
                        "wake_ups": m["wake_ups"], "wake_p99_s_whole_model": m["wake_s"]["whole-model"]["p99"],
                        "wake_p99_s_expert_grain": m["wake_s"]["expert-grain"]["p99"],
                        "cold_starts_outside_wakes": m["cold_starts_outside_wakes"],
                        "step_p99_s_dedicated": m["step_p99_s"]["dedicated"],
                        "step_p99_s_expert_grain": m["step_p99_s"]["expert-grain"],
                        "step_p99_ratio": _p99_ratio(m),
                        "step_p99_ratio_shared_gpus": _p99_ratio(m, "expert-grain-shared-gpus"),
                        "step_p99_ratio_whole_model_shared_gpus": _p99_ratio(m, "whole-model-shared-gpus")})
    return out


def _p99_ratio(m: dict, way: str = "expert-grain") -> float | None:
    """A way's p99 step time (default the expert grain's) / dedicated (None: the model never computed
    outside a wake-up)."""
    base = m["step_p99_s"]["dedicated"]
    return m["step_p99_s"][way] / base if base else None


def acceptance(run: dict) -> list[dict]:
    """Per level, the issue's targets with the numbers that meet or miss them."""
    out = []
    for level in run["levels"]:
        idle = float(sum(m["idle_fraction"] for m in level["models"]) / len(level["models"]))
        ratio = level["gpu_s_ratio_to_dedicated"]
        wakes = [(m["wake_s"]["expert-grain"]["p99"], m["wake_s"]["whole-model"]["p99"]) for m in level["models"] if m["wake_ups"]]
        p99s = [r for r in map(_p99_ratio, level["models"]) if r is not None]
        met = [r for m in level["models"] if (r := _p99_ratio(m, "expert-grain-shared-gpus")) is not None]
        out.append({"requests_per_minute": level["requests_per_minute"], "mean_idle_fraction": idle,
                    "expert_grain_ratio": ratio["expert-grain"], "whole_model_ratio": ratio["whole-model"],
                    "fewer_than_dedicated": ratio["expert-grain"] < 1,
                    "fewer_than_whole_model": ratio["expert-grain"] < ratio["whole-model"],
                    "target_ratio_met": ratio["expert-grain"] <= TARGET_RATIO if idle >= 0.5 else None,
                    "p99_within_target": all(r <= TARGET_P99 for r in p99s) if p99s else None,
                    "p99_worst_ratio": max(p99s) if p99s else None,
                    "p99_shared_gpus_worst_ratio": max(met) if met else None,
                    "wake_ups_shorter": all(e < w for e, w in wakes) if wakes else None})
    return out


def _plot(run: dict, path: Path) -> Path:
    plt, fig, axes = figure(1)
    ax = axes[0][0]
    levels = [lv["requests_per_minute"] for lv in run["levels"]]
    for way in WAYS:
        ax.plot(levels, [lv["gpu_s_ratio_to_dedicated"][way] for lv in run["levels"]], marker="o", label=way, linewidth=1.2)
    ax.axhline(TARGET_RATIO, color="grey", linestyle=":", linewidth=1)
    ax.set(xscale="log", xlabel="requests per minute per model", ylabel="GPU-seconds / dedicated pools'",
           title="GPU-seconds of the pool, three ways")
    ax.legend(loc="lower right")
    return _save(plt, fig, path)


def _p99_cell(m: dict) -> str:
    ratio = _p99_ratio(m)
    if ratio is None:
        return "–"
    return f"{m['step_p99_s']['dedicated'] * 1e3:.2f} / {m['step_p99_s']['expert-grain'] * 1e3:.2f} ({ratio:.2f}x)"


def _yes(value) -> str:
    return "–" if value is None else ("yes" if value else "**no**")


def _markdown(run: dict, checks: list[dict]) -> str:
    s = run["settings"]
    lines = ["# One pool for several models, in the twin", "",
             "Written by one command (re-run it to refresh every figure here):", "", "```", run["command"], "```", "",
             "**Simulated**: every figure below is the digital twin's, with load times and expert compute priced by the "
             "GPUs' roofline (estimates, not measurements); arrivals and prompt lengths are real traces.", "",
             f"{len(run['models'])} models on {run['gpu']} GPUs ({run['gpu_bytes_for_weights'] / 1e9:.0f} GB of each for "
             f"weights), a horizon of {s['horizon_s']:g} s in windows of {s['window_s']:g} s; a shared pool puts a model to "
             f"sleep after {s['idle_delay_s']:g} s without a request; the expert-grain pool evicts an expert after "
             f"{s['keep_alive_s']:g} s without a token"
             + (f"; each model keeps {s['keep_warm']:.0%} of each layer's experts (its most popular) warm while asleep"
                if s.get("keep_warm") else "")
             + ". How each way is modelled, and what is not: twin/shared_pool.py.", "",
             "## The models", "",
             "| model | dedicated GPUs | weights GB | expert MB | layers x experts, k | whole-model wake s | routing | workload |",
             "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for m in run["models"]:
        lines.append(f"| {m['name']} | {m['dedicated_gpus']} | {m['weight_gb']:.1f} | {m['expert_mb']:.0f} | "
                     f"{m['layers']} x {m['experts']}, {m['top_k']} | {m['whole_load_s']:.2f} | {m['routing']} | {m['workload']} |")
    lines += ["", "## GPU-seconds per load level", "", "![GPU-seconds](RUN/gpu-seconds.png)", "",
              "| requests/min per model | idle share per model | " + " | ".join(f"{w} GPU-s" for w in WAYS)
              + " | pool busy share (expert-grain) |", "| --- | --- | " + " | ".join("---" for _ in WAYS) + " | --- |"]
    for lv in run["levels"]:
        idle = ", ".join(f"{m['idle_fraction']:.0%}" for m in lv["models"])
        cells = " | ".join(f"{lv['gpu_s'][w]:.0f} ({lv['gpu_s_ratio_to_dedicated'][w]:.3f}x)" for w in WAYS)
        lines.append(f"| {lv['requests_per_minute']:g} | {idle} | {cells} | {lv['busy_fraction']['expert-grain']:.2%} |")
    lines += ["", "## Per model: GB·s held, wake-ups, cold starts outside them", "",
              "| requests/min | model | requests | " + " | ".join(f"GB·s {w}" for w in WAYS)
              + " | wake-ups | wake p99 s whole-model / expert-grain | cold starts outside wake-ups (s exposed) "
              "| p99 MoE ms per step outside wake-ups, dedicated / expert-grain |",
              "| --- | --- | --- | " + " | ".join("---" for _ in WAYS) + " | --- | --- | --- | --- |"]
    for lv in run["levels"]:
        for m in lv["models"]:
            wake = m["wake_s"]
            pair = "–" if not m["wake_ups"] else f"{wake['whole-model']['p99']:.2f} / {wake['expert-grain']['p99']:.2f}"
            lines.append(f"| {lv['requests_per_minute']:g} | {m['model']} | {m['requests']} | "
                         + " | ".join(f"{m['gb_s'][w]:.3g}" for w in WAYS)
                         + f" | {m['wake_ups']} | {pair} | {m['cold_starts_outside_wakes']} ({m['cold_start_s_outside_wakes']:.2f}) | "
                         + _p99_cell(m) + " |")
    lines += ["", "## The targets", "",
              f"| requests/min | mean idle share | expert-grain / dedicated | fewer GPU-s than dedicated | than whole-model "
              f"| <= {TARGET_RATIO}x where idle >= 50% | p99 per step <= {TARGET_P99}x dedicated (worst) | same, the models' calls "
              "meeting on the pool's GPUs (worst) | wake-ups shorter |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in checks:
        lines.append(f"| {c['requests_per_minute']:g} | {c['mean_idle_fraction']:.0%} | {c['expert_grain_ratio']:.3f}x | "
                     f"{_yes(c['fewer_than_dedicated'])} | {_yes(c['fewer_than_whole_model'])} | {_yes(c['target_ratio_met'])} | "
                     f"{_yes(c['p99_within_target'])}" + (f" ({c['p99_worst_ratio']:.2f}x)" if c["p99_worst_ratio"] else "")
                     + " | " + ("–" if c["p99_shared_gpus_worst_ratio"] is None else
                                f"{_yes(c['p99_shared_gpus_worst_ratio'] <= TARGET_P99)} ({c['p99_shared_gpus_worst_ratio']:.2f}x)")
                     + f" | {_yes(c['wake_ups_shorter'])} |")
    return "\n".join(lines) + "\n"
