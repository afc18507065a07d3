"""Render a `moeless eval --shared-pool --finetunes ...` run (finetune_run.py): report.md,
finetunes.csv (one row per fine-tune and cell), report.json and gpu-seconds.png, the same bytes from
the same run.json; `section` is the same report as a section of the shared pool's
(docs/shared-pool.md renders RUN_DIR/finetunes beside its own run)."""

from __future__ import annotations

import json
from pathlib import Path
from statistics import median

from moeless.evaluation.finetune_run import FORMAT
from moeless.evaluation.plots import _figure as figure, _save
from moeless.evaluation.report import NOTES_FILE, load_run, rows_csv, write_markdown, write_text
from moeless.twin.finetunes import ALL_WAYS, GATED, SHARED_KEYS, SIZED

TARGET_P99 = 1.1  # each fine-tune's p99 MoE time per step outside wake-ups / its dedicated pool's (as the shared pool's)
TARGET_RATIO = 0.3  # shared-keys GPU-seconds / the whole-model pool's, 16 fine-tunes at 1 request a minute
TARGET_WAKE = 0.1  # a fine-tune's wake-up with its base warm / a whole-model wake-up
MUST_SHOW = (16, 1.0)  # (fine-tunes, requests per minute each) of the targets
SUBDIR = "finetunes"  # where a shared-pool run directory keeps its fine-tunes' run


def render(run_dir: str | Path, markdown: str | Path | None = None) -> list[Path]:
    """Write the report into run_dir (and the markdown also to `markdown`); returns the files written."""
    run_dir = Path(run_dir)
    run = load_run(run_dir, FORMAT)
    checks = acceptance(run)
    written = [write_text(run_dir / "finetunes.csv", rows_csv(rows(run))),
               write_text(run_dir / "report.json", json.dumps({"format": "moeless-shared-pool-finetunes-report/1",
                                                            "command": run["command"], "rows": rows(run),
                                                            "acceptance": checks}, indent=1, sort_keys=True) + "\n"),
               _plot(run, run_dir / "gpu-seconds.png")]
    return write_markdown(run_dir, _markdown(run, checks, run_dir, "#", "RUN"), markdown) + written


def section(run_dir: Path, link: str) -> str:
    """The report of the fine-tunes' run in run_dir as a section (its images under `link`), "" without one."""
    try:
        run = load_run(run_dir, FORMAT)
    except ValueError:
        return ""
    return "\n" + _markdown(run, acceptance(run), run_dir, "##", link)


def rows(run: dict) -> list[dict]:
    """One row per (cell, fine-tune): GB·s and GPU-seconds each way, the parts, wake-ups, p99 per step."""
    out = []
    for c in run["cells"]:
        for m in c["models"]:
            out.append({"base": c["base"], "replaced": c["replaced"], "finetunes": c["finetunes"],
                        "requests_per_minute": c["requests_per_minute"], "model": m["model"], "requests": m["requests"],
                        "idle_fraction": m["idle_fraction"], "own_experts": m["own_experts"],
                        **{f"gb_s_{w}": m["gb_s"][w] for w in ALL_WAYS},
                        **{f"gb_s_shared_keys_{p}": v for p, v in m["gb_s_shared_keys_parts"].items()},
                        **{f"gpu_s_{w}": m["gpu_s"][w] for w in ALL_WAYS},
                        "wake_ups": m["wake_ups"], "wake_ups_base_warm": m["wake_s"]["shared-keys-base-warm"]["count"],
                        **{f"wake_p99_s_{w}": m["wake_s"][w]["p99"] for w in ("whole-model", "expert-grain", SHARED_KEYS,
                                                                             "shared-keys-base-warm")},
                        "cold_starts_expert_grain": m["cold_starts_outside_wakes"],
                        "cold_starts_shared_keys": m["cold_starts_outside_wakes_shared_keys"],
                        **{f"step_p99_s_{w}": m["step_p99_s"][w] for w in ("dedicated", SHARED_KEYS, "shared-keys-batched",
                                                                            SIZED, GATED)},
                        "scale_up_waited": m["scale_up_waits"]["waited"], "scale_up_wait_p99_s": m["scale_up_waits"]["p99"]})
    return out


def _ratio(m: dict, way: str) -> float | None:
    base = m["step_p99_s"]["dedicated"]
    return m["step_p99_s"][way] / base if base else None


def _worst(values) -> float | None:
    values = [v for v in values if v is not None]
    return max(values) if values else None


def acceptance(run: dict) -> list[dict]:
    """Per cell of several fine-tunes, the issue's targets with the numbers that meet or miss them."""
    out = []
    for c in run["cells"]:
        if c["finetunes"] < 2:
            continue
        gpu = c["gpu_s"]
        ratio = gpu[SHARED_KEYS] / gpu["whole-model"] if gpu["whole-model"] else None
        alone = _worst(_ratio(m, SHARED_KEYS) for m in c["models"])
        batched = _worst(_ratio(m, "shared-keys-batched") for m in c["models"])
        sized = c["gpu_s_sized_for_step"] / gpu["whole-model"] if gpu["whole-model"] else None
        sized_p99 = _worst(_ratio(m, SIZED) for m in c["models"])
        gated_p99 = _worst(_ratio(m, GATED) for m in c["models"])
        waits = [m["scale_up_waits"]["p99"] / m["whole_load_s"] for m in c["models"] if m["scale_up_waits"]["count"]]
        wake, gated_wake = (_worst(m["wake_s"][way]["p99"] / m["whole_load_s"]
                                   for m in c["models"] if m["wake_s"][way]["count"])
                            for way in ("shared-keys-base-warm", "shared-keys-base-warm-gated"))
        out.append({"base": c["base"], "replaced": c["replaced"], "finetunes": c["finetunes"],
                    "requests_per_minute": c["requests_per_minute"],
                    "must_show": (c["finetunes"], c["requests_per_minute"]) == MUST_SHOW,
                    "gpu_s_ratio_to_whole_model": ratio, "gpu_ratio_met": None if ratio is None else ratio <= TARGET_RATIO,
                    "gpu_s_ratio_own_non_expert": c["gpu_s_own_non_expert"] / gpu["whole-model"] if gpu["whole-model"] else None,
                    "p99_alone_worst": alone, "p99_alone_met": None if alone is None else alone <= TARGET_P99,
                    "p99_batched_worst": batched, "p99_batched_met": None if batched is None else batched <= TARGET_P99,
                    "sized_gpu_s_ratio_to_whole_model": sized, "sized_p99_batched_worst": sized_p99,
                    "sized_met": None if sized is None or sized_p99 is None else sized <= TARGET_RATIO and sized_p99 <= TARGET_P99,
                    "gated_p99_batched_worst": gated_p99,
                    "gated_met": None if sized is None or gated_p99 is None else sized <= TARGET_RATIO and gated_p99 <= TARGET_P99,
                    "gated_waited_worst": max(m["scale_up_waits"]["waited"] for m in c["models"]),
                    "gated_wait_p99_of_whole_wake_worst": max(waits) if waits else None,
                    "gated_wake_base_warm_worst": gated_wake,
                    "wake_base_warm_worst": wake, "wake_met": None if wake is None else wake < TARGET_WAKE})
    return out


def _plot(run: dict, path: Path) -> Path:
    bases = [b["name"] for b in run["bases"]]
    plt, fig, axes = figure(len(bases))
    for ax, base in zip(axes[0], bases):
        cells = [c for c in run["cells"] if c["base"] == base]
        for color, share in enumerate(sorted({c["replaced"] for c in cells})):  # a colour per share, a dash per level
            for dash, level in enumerate(sorted({c["requests_per_minute"] for c in cells})):
                line = sorted((c["finetunes"], c["gpu_s"][SHARED_KEYS] / c["gpu_s"]["whole-model"]) for c in cells
                              if c["replaced"] == share and c["requests_per_minute"] == level and c["gpu_s"]["whole-model"])
                ax.plot([n for n, _ in line], [r for _, r in line], marker="o", linewidth=1.2, color=f"C{color}",
                        linestyle=(":", "-", "--", "-.")[dash % 4], label=f"{share:.0%} replaced, {level:g}/min")
        ax.axhline(TARGET_RATIO, color="grey", linestyle=":", linewidth=1)
        ax.set(xscale="log", ylim=(0, 1.05), xlabel="fine-tunes on the pool", ylabel="GPU-s, shared keys / whole-model pool",
               title=f"fine-tunes of {base}")
        ax.set_xticks(sorted({c["finetunes"] for c in cells}), [str(n) for n in sorted({c["finetunes"] for c in cells})])
        ax.legend(loc="lower left")
    return _save(plt, fig, path)


def _yes(value) -> str:
    return "–" if value is None else ("yes" if value else "**no**")


def _x(value, digits: int = 2) -> str:
    return "–" if value is None else f"{value:.{digits}f}x"


def _spread(values: list[float], fmt: str = "{:.3g}") -> str:
    return f"{fmt.format(median(values))} ({fmt.format(min(values))}-{fmt.format(max(values))})"


def _scale_up_copies(s: dict) -> str:
    """How a scale-up's added GPUs get their keys, by the run's settings (runs before peer_copy_s: not said)."""
    if s.get("scale_up_copies") == "host":
        return ", its added GPUs loading their keys from host memory"
    if "peer_copy_s" not in s:
        return ""
    batched = (f", an ask carrying the replicas that fit {s['peer_batch_bytes'] / 1e6:g} MB"
               if s.get("peer_batch_bytes") else ", one ask a replica")
    return f", its added GPUs copying their keys from peer GPUs at {s['peer_copy_s'] * 1e3:g} ms an ask beside the bytes{batched}"


def _markdown(run: dict, checks: list[dict], run_dir: Path, h: str, link: str) -> str:
    s = run["settings"]
    written = ("Written by one command (re-run it to refresh every figure here):" if h == "#" else
               f"Written by this command into the run directory above's `{SUBDIR}/`; `moeless report` of that run "
               "directory (with --markdown) then renders it here:")
    lines = [f"{h} Many fine-tunes of one base on one pool, in the twin", "", written, "",
             "```", run["command"], "```", "",
             "**Simulated**: the digital twin's figures, load times and compute priced by the GPUs' roofline; arrivals "
             "and prompt lengths are real traces. Each fine-tune replaces a share of its base's experts, ESFT-style "
             "(per layer, the experts its task routes the most tokens to; its task's routing: the base's measured routing "
             "on other experts), and is otherwise its base's bytes. Four ways: a dedicated static-EP pool per fine-tune; "
             "one pool of whole models (no sharing); moeless's expert-grain pool with each fine-tune a model of its own; "
             "moeless's pool with experts addressed by content (shared keys: one replica of an expert the fine-tunes did "
             "not change serves them all, the non-expert weights held once). A shared replica's GB·s are split as the "
             "expert hosts split them (expert_fn/host/meters.py): each window, evenly among the fine-tunes claiming it "
             "(routed to it within the keep-alive, prefetched it on waking, or keep it warm), the non-expert weights "
             "evenly among the fine-tunes awake, so the fine-tunes' GB·s add up to the pool's; a fine-tune's "
             "GPU-seconds in a shared pool are the pool's in the ratio of its GB·s. How it is modelled and what is not: "
             "twin/finetunes.py, twin/shared_keys.py.",
             "",
             f"{run['gpu']} GPUs ({run['gpu_bytes_for_weights'] / 1e9:.0f} GB of each for weights), a horizon of "
             f"{s['horizon_s']:g} s in windows of {s['window_s']:g} s, sleep after {s['idle_delay_s']:g} s without a request, "
             f"an expert evicted after {s['keep_alive_s']:g} s without a token"
             + ("; with shared keys the base stays whole while a fine-tune calls (the hosts' family warmth, "
                "expert_fn/host/model_calls.py)" if s.get("family_warm", False) else "")
             + (f"; the pool sized for its step's SLO keeps a GPU added for it {s['step_hold_s']:g} s, its scaler "
                + (f"{s['step_lag_s']:g} s late" if s.get("step_lag_s") else "in the engine's step loop")
                + _scale_up_copies(s) if "step_hold_s" in s else "")
             + ". Fine-tune i takes workload i mod "
             f"{len(run['workloads'])}: " + "; ".join(f"{j}: {w}" for j, w in enumerate(run["workloads"])) + ".", "",
             f"{h}# The bases", "",
             "| base | dedicated GPUs per fine-tune | weights GB (non-expert) | expert MB | layers x experts, k | "
             "experts a fine-tune owns | whole-model wake s | routing |", "| --- | --- | --- | --- | --- | --- | --- | --- |"]
    for b in run["bases"]:
        owns = ", ".join(f"{float(x):.0%}: {n}" for x, n in b["own_experts"].items())
        lines.append(f"| {b['name']} | {b['dedicated_gpus']} | {b['weight_gb']:.1f} ({b['non_expert_gb']:.2f}) | "
                     f"{b['expert_mb']:.1f} | {b['layers']} x {b['experts']}, {b['top_k']} | {owns} | "
                     f"{b['whole_load_s']:.2f} | {'; '.join(b['routing'])} |")
    lines += ["", f"{h}# GPU-seconds of the pool", "", f"![GPU-seconds]({link}/gpu-seconds.png)", "",
              "| base | replaced | fine-tunes | requests/min each | " + " | ".join(f"{w} GPU-s" for w in ALL_WAYS)
              + " | shared keys / whole-model | same, non-expert weights per fine-tune | same, sized for its batched "
              "step's SLO | shared keys / whole models on GPUs of their own | busy share (shared keys) |",
              "| --- | --- | --- | --- | " + " | ".join("---" for _ in ALL_WAYS) + " | --- | --- | --- | --- | --- |"]
    for c in run["cells"]:
        whole = c["gpu_s"]["whole-model"]
        lines.append(f"| {c['base']} | {c['replaced']:.0%} | {c['finetunes']} | {c['requests_per_minute']:g} | "
                     + " | ".join(f"{c['gpu_s'][w]:.0f}" for w in ALL_WAYS)
                     + f" | {_x(c['gpu_s'][SHARED_KEYS] / whole if whole else None, 3)} | "
                     f"{_x(c['gpu_s_own_non_expert'] / whole if whole else None, 3)} | "
                     f"{_x(c['gpu_s_sized_for_step'] / whole if whole else None, 3)} | "
                     f"{_x(c['gpu_s'][SHARED_KEYS] / own if (own := c['gpu_s_whole_model_own_gpus']) else None, 3)} | "
                     f"{c['busy_fraction'][SHARED_KEYS]:.2%} |")
    lines += ["", f"{h}# Per fine-tune", "",
              "GB·s per fine-tune as median (min-max) over the cell's fine-tunes; the p99 MoE time per step outside "
              "wake-ups of the fine-tune whose batched ratio is the worst: dedicated / shared keys alone (its own tokens, "
              "its cold starts: the house figure of docs/shared-pool.md) / batched (every busy fine-tune's tokens in the "
              "engine's step) / batched on a pool sized for that step (each busy fine-tune's step SLO: its dedicated "
              "p99 step; twin/finetunes.step_floor) / the same with newcomers waiting for a scale-up (gated).", "",
              "| base | replaced | fine-tunes | requests/min | GB·s whole-model | GB·s shared keys | of which own / base / "
              "non-expert (medians) | shared keys / whole-model | wake p99 s: whole-model / base warm (wake-ups with the "
              "base warm / all) | p99 MoE ms per step: dedicated / alone / batched / batched, sized / same, gated |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for c in run["cells"]:
        ms = c["models"]
        parts = " / ".join(f"{median(m['gb_s_shared_keys_parts'][p] for m in ms):.3g}" for p in ("own", "base", "non-expert"))
        ratios = [m["gb_s"][SHARED_KEYS] / m["gb_s"]["whole-model"] for m in ms if m["gb_s"]["whole-model"]]
        warm = [m["wake_s"]["shared-keys-base-warm"]["p99"] for m in ms if m["wake_s"]["shared-keys-base-warm"]["count"]]
        wakes = f"{ms[0]['whole_load_s']:.2f} / " + (f"{max(warm):.3f}" if warm else "–") + \
            f" ({sum(m['wake_s']['shared-keys-base-warm']['count'] for m in ms)} / {sum(m['wake_ups'] for m in ms)})"
        worst = max(ms, key=lambda m: _ratio(m, "shared-keys-batched") or 0.0)
        p99 = " / ".join(f"{worst['step_p99_s'][w] * 1e3:.2f}" for w in ("dedicated", SHARED_KEYS, "shared-keys-batched",
                                                                          SIZED, GATED))
        lines.append(f"| {c['base']} | {c['replaced']:.0%} | {c['finetunes']} | {c['requests_per_minute']:g} | "
                     f"{_spread([m['gb_s']['whole-model'] for m in ms])} | {_spread([m['gb_s'][SHARED_KEYS] for m in ms])} | "
                     f"{parts} | {_spread(ratios, '{:.3f}') if ratios else '–'} | {wakes} | {p99} |")
    lines += ["", f"{h}# The targets", "",
              f"Rows of {MUST_SHOW[0]} fine-tunes at {MUST_SHOW[1]:g} request/min each are the issue's (bold); the others show the trend.", "",
              f"| base | replaced | fine-tunes | requests/min | shared keys / whole-model GPU-s <= {TARGET_RATIO} | "
              f"p99 per step <= {TARGET_P99}x dedicated, alone (worst) | batched (worst) | base-warm wake < "
              f"{TARGET_WAKE:.0%} of a whole-model wake (worst p99) | the one engine on a pool sized for its step "
              "SLO: both (GPU-s ratio, batched p99 worst) | same, newcomers waiting for a scale-up: both (batched p99 "
              "worst; requests waiting, their p99 wait / a whole-model wake, worst; base-warm wake with that wait, "
              "worst p99) |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]
    for k in checks:
        b = "**" if k["must_show"] else ""
        lines.append(f"| {b}{k['base']}{b} | {k['replaced']:.0%} | {b}{k['finetunes']}{b} | {b}{k['requests_per_minute']:g}{b} | "
                     f"{_yes(k['gpu_ratio_met'])} ({_x(k['gpu_s_ratio_to_whole_model'], 3)}) | "
                     f"{_yes(k['p99_alone_met'])} ({_x(k['p99_alone_worst'])}) | {_yes(k['p99_batched_met'])} "
                     f"({_x(k['p99_batched_worst'])}) | {_yes(k['wake_met'])} "
                     + ("(–)" if k["wake_base_warm_worst"] is None else f"({k['wake_base_warm_worst']:.1%})")
                     + f" | {_yes(k['sized_met'])} ({_x(k['sized_gpu_s_ratio_to_whole_model'], 3)}, "
                     f"{_x(k['sized_p99_batched_worst'])}) | {_yes(k['gated_met'])} ({_x(k['gated_p99_batched_worst'])}; "
                     f"{k['gated_waited_worst']:.1%}, " + ("–" if k["gated_wait_p99_of_whole_wake_worst"] is None
                                                          else f"{k['gated_wait_p99_of_whole_wake_worst']:.0%}")
                     + ("; wake –" if k["gated_wake_base_warm_worst"] is None
                        else f"; wake {k['gated_wake_base_warm_worst']:.1%}") + ") |")
    notes = run_dir / NOTES_FILE
    if notes.is_file():
        lines += ["", f"{h}# Notes", "", notes.read_text().strip()]
    return "\n".join(lines) + "\n"
