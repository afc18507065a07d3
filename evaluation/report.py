"""`moeless report RUN_DIR`: RUN_DIR/run.json -> report.md, report.json, tables/*.csv, plots/*.png.

A pure function of run.json (no clock, no machine facts), so re-rendering a run directory writes
the same bytes. RUN_DIR/notes.md, when present (written by a person after reading the run), is
included verbatim after the claims table as "Reading the results".
"""

from __future__ import annotations

import csv
import io
import json
import os
from pathlib import Path

from moeless.evaluation import plots
from moeless.evaluation import tables as t
from moeless.evaluation.evaluate import FORMAT, RUN_FILE

NOTES_FILE = "notes.md"


class RunDirError(ValueError):
    """A run directory without a readable run.json of this format."""


def run_format(run_dir: str | Path) -> str | None:
    """The format a run directory's run.json names (None: no readable one): which report renders it."""
    try:
        return json.loads((Path(run_dir) / RUN_FILE).read_text()).get("format")
    except (OSError, ValueError, AttributeError):
        return None


def load_run(run_dir: str | Path, fmt: str = FORMAT) -> dict:
    """RUN_DIR/run.json, which must be of format `fmt` (RunDirError says what is wrong)."""
    path = Path(run_dir) / RUN_FILE
    try:
        doc = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunDirError(f"{run_dir}: no {RUN_FILE}; a run directory is what `moeless eval --out DIR` writes") from None
    except (OSError, json.JSONDecodeError) as err:
        raise RunDirError(f"{path}: not a readable run file ({err}); re-run `moeless eval`") from None
    if not isinstance(doc, dict) or doc.get("format") != fmt:
        raise RunDirError(f"{path}: not a {fmt} run file; re-run `moeless eval` with this version")
    return doc


def rows_csv(rows: list[dict]) -> str:
    """Report rows (dicts with the same keys) as CSV, floats to 6 significant digits."""
    buf = io.StringIO()
    writer = csv.DictWriter(buf, fieldnames=list(rows[0]) if rows else ["model"], lineterminator="\n")
    writer.writeheader()
    for r in rows:
        writer.writerow({k: (f"{v:.6g}" if isinstance(v, float) else v) for k, v in r.items()})
    return buf.getvalue()


def notes_section(run_dir: Path) -> str:
    """RUN_DIR/notes.md as the report's last section ("" without one)."""
    notes = run_dir / NOTES_FILE
    return f"\n## Notes\n\n{notes.read_text().strip()}\n" if notes.is_file() else ""


def render(run_dir: str | Path, markdown: str | Path | None = None) -> list[Path]:
    """Write the report into run_dir (and the markdown also to `markdown`); returns the files written."""
    doc = load_run(run_dir)
    run = Path(run_dir)
    (run / "tables").mkdir(exist_ok=True)
    (run / "plots").mkdir(exist_ok=True)
    sections, all_tables, written = [], [t.claims_table(doc)], []
    for w in doc["workloads"]:
        section, tables, images = _workload(doc, w, run)
        sections.append(section)
        all_tables += tables
        written += images
    for table in all_tables:
        written.append(write_text(run / "tables" / f"{table.name}.csv", _csv(table)))
    report = {"format": "moeless-eval-report/1", "command": doc["command"],
              "tables": [{k: getattr(table, k) for k in ("name", "title", "caption", "columns", "rows")} for table in all_tables]}
    written.append(write_text(run / "report.json", json.dumps(report, indent=1) + "\n"))
    notes = run / NOTES_FILE
    body = _markdown(doc, all_tables[0], sections, notes.read_text() if notes.is_file() else None)
    return write_markdown(run, body, markdown) + written


def write_markdown(run: Path, body: str, markdown: str | Path | None) -> list[Path]:
    """RUN/report.md, and a copy at `markdown` (e.g. docs/) whose links still reach the run's files:
    `body` links them as `RUN/...`."""
    written = [write_text(run / "report.md", body.replace("](RUN/", "]("))]
    if markdown is not None:
        markdown = Path(markdown)
        link = Path(os.path.relpath(run.resolve(), markdown.resolve().parent)).as_posix()
        written.append(write_text(markdown, body.replace("](RUN/", f"]({link}/")))
    return written


def write_text(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def _workload(doc: dict, w: dict, run: Path) -> tuple[str, list[t.Table], list[Path]]:
    """The workload's markdown section (image links as RUN/...), its tables and its plots."""
    name, first = w["name"], doc["batchings"][0]
    out = [f"## Workload `{name}`\n",
           f"- Arrivals: {w['arrivals']} ({w['requests']} requests).",
           f"- Prompts and loads: {w['loads']}."]
    for mode, b in w["batchings"].items():
        out.append(f"- `{mode}` batching: {b['iterations']} iterations ({b['prefill_iterations']} prefill).")
    tables, images = [], []
    for mode, b in w["batchings"].items():
        tag = f"{name}-{mode}"
        out.append(f"\n### `{mode}` batching{' (ablations and sweeps below use it)' if mode == first else ''}\n")
        group = [t.time_table(f"{tag}-time-serial", name, mode, b, "serial"), t.time_table(f"{tag}-time-paper", name, mode, b, "paper"),
                 t.cost_table(f"{tag}-cost", name, mode, b), t.replicas_table(f"{tag}-replicas", name, mode, b),
                 t.accuracy_table(f"{tag}-accuracy", name, b)]
        if mode == first:
            group += [x for x in (t.ablation_table(f"{tag}-ablations", name, b), t.distance_table(f"{tag}-distance", name, b),
                                  t.cv_table(f"{tag}-cv", name, b)) if x is not None]
        pictures = _plots(run / "plots", tag, b, doc["model"]["layers"])
        images += pictures.values()
        for table in group:
            out.append(_md_table(table))
            kind = table.name[len(tag) + 1:]
            if kind in pictures:
                out.append(f"![{table.title}](RUN/plots/{pictures[kind].name})\n")
        tables += group
    return "\n".join(out), tables, images


def _plots(folder: Path, tag: str, b: dict, num_layers: int) -> dict[str, Path]:
    """The batching's plots, keyed by the table each goes under."""
    cases = t.main_cases(b)
    out = {}
    for execution in ("serial", "paper"):
        panels = [(f"{phase}: {execution} execution, cold starts incl.",
                   {c["label"]: [v * t.US for v in c["figures"][phase][f"{execution}_cold_cdf_s"]] for c in cases if phase in c["figures"]})
                  for phase in ("prefill", "decode") if any(phase in c["figures"] for c in cases)]
        out[f"time-{execution}"] = plots.cdf(folder / f"{tag}-cdf-{execution}.png", panels, "MoE-layer time (us)")
    labels = [c["label"] for c in cases]
    non = [c["figures"]["all"]["gb_s_non_expert"] for c in cases]
    out["cost"] = plots.stacked_bars(folder / f"{tag}-cost.png", [
        ("resident billing", labels, {"experts": [c["figures"]["all"]["gb_s_expert_resident"] for c in cases], "non-expert": non}),
        ("per-layer billing (serial time)", labels,
         {"experts": [c["figures"]["all"]["gb_s_expert_per_layer_serial"] for c in cases], "non-expert": non})], "GB·s")
    layers = list(range(num_layers))
    out["replicas"] = plots.lines(folder / f"{tag}-replicas.png", [
        ("resident replicas per layer (time-weighted)", "MoE layer", "replicas",
         {c["label"]: (layers, c["figures"]["all"]["replicas_resident_per_layer"]) for c in cases})])
    static = t.find(cases, "static")
    sweep = [c for c in b["cases"] if c["group"] == "distance"]
    if sweep:
        ds = [c["distance"] for c in sweep]
        accuracy = {r["distance"]: r["all"] for r in b["accuracy"] if r["forecast"] == "predictor"}
        out["distance"] = plots.lines(folder / f"{tag}-sweep-distance.png", [
            ("MoE-layer time vs d (cold starts incl.)", "prediction distance d", "us",
             {**{f"{sweep[0]['planner']}, {x}": (ds, [c["figures"]["all"][f"{x}_cold_mean_s"] * t.US for c in sweep]) for x in ("serial", "paper")},
              "static EP, serial": (ds, [static["figures"]["all"]["serial_cold_mean_s"] * t.US] * len(ds))}),
            ("forecast accuracy vs d", "prediction distance d", "load accuracy",
             {"gate replicas": (ds, [accuracy.get(d) or 0.0 for d in ds])})])
    sweep = [c for c in b["cases"] if c["group"] == "cv"]
    if sweep:
        vs = [c["cv_threshold"] for c in sweep]
        ours = t.find(cases, "moeless", "predictor")
        out["cv"] = plots.lines(folder / f"{tag}-sweep-cv.png", [
            ("MoE-layer time vs V (cold starts incl.)", "CV threshold V", "us",
             {**{f"paper's planner, {x}": (vs, [c["figures"]["all"][f"{x}_cold_mean_s"] * t.US for c in sweep]) for x in ("serial", "paper")},
              "moeless (no V), serial": (vs, [ours["figures"]["all"]["serial_cold_mean_s"] * t.US] * len(vs))}),
            ("replicas vs V", "CV threshold V", "resident replicas per layer",
             {"paper's planner": (vs, [c["figures"]["all"]["replicas_resident"] for c in sweep])})])
    return out


def _markdown(doc: dict, claims: t.Table, sections: list[str], notes: str | None) -> str:
    p, c, m, k = doc["profile"], doc["cluster"], doc["model"], doc["knobs"]
    head = [
        "# moeless evaluation: replayed serving, every planner, every cost\n",
        "Generated by `moeless report` from the run directory's run.json; do not edit by hand (re-render with "
        "`moeless report RUN_DIR`). Reproduce the run with:\n",
        f"```\n{doc['command']}\n```\n",
        "## Set-up\n",
        f"- Model: {m['source']} ({m['layers']} MoE layers, {m['experts']} experts, top-{m['top_k']}); "
        f"real routing and the gate-replica predictor's forecasts of every request.",
        f"- Cluster: {c['gpus']} GPUs, at most {c['layer_cap_replicas']} replicas per layer, {c['slots_per_gpu']} replica "
        f"slots per GPU; one replica {c['expert_bytes']:,} bytes; cold starts load from the {c['tier']} tier "
        f"({c['cold_start_s'] * 1e3:.3f} ms each).",
        f"- Cost profile ({p['source']}): alpha {p['alpha'] * 1e9:.1f} ns/token, call overhead {p['call_overhead'] * 1e6:.1f} us, "
        f"beta {p['beta'] * 1e9:.2f} ns/token, load {p['load_s']['disk'] * 1e3:.3f} ms from disk / "
        f"{p['load_s']['host'] * 1e3:.3f} ms from host memory, non-expert weights {p['non_expert_bytes'] / 1e6:.1f} MB.",
        "- Knobs: " + ", ".join(f"{key} {value}" for key, value in k.items()) + f"; planner horizon {doc['planner']['horizon']} "
        f"iterations, GB·s price {doc['planner']['gb_s_price']:.3g} s; one iteration {doc['planner']['iteration_s'] * 1e3:g} ms.",
        "- Models named in every table. Execution: `serial` (a GPU runs its replicas one after another on whole tokens, "
        "each call paying the call overhead) and `paper` (the paper's formula: replicas in parallel, fractional "
        "splits). Billing: `resident` (memory held from load to eviction) and `per-layer` (the paper's C). Cold starts: "
        "a replica's load starts when the forecast d layers ahead names it; only the part a layer waits for (exposed) "
        "costs time. Forecasts: gate replicas at distance d, the previous iteration, a history window, or perfect.",
        "- The twin's iteration clock is fixed (one step per iteration): layer times do not stretch the run, so the "
        "non-expert GB·s is the same for every planner.\n",
        "## Against the paper's claims\n",
        "The paper reports -43% mean MoE-layer time against Megatron-LM (static EP), -22% against EPLB and -84% cost "
        "against the Oracle. The same comparisons here, under each model:\n",
        _md_table(claims),
    ]
    reading = [f"## Reading the results\n\n{notes.strip()}\n"] if notes else []
    return "\n".join([*head, *reading, *sections]).rstrip() + "\n"


def _md_table(table: t.Table) -> str:
    lines = [f"**{table.title}.** {table.caption}\n", "| " + " | ".join(table.columns) + " |",
             "| " + " | ".join("---" for _ in table.columns) + " |"]
    for row in table.rows:
        lines.append("| " + " | ".join(_cell(v, f) for v, f in zip(row, table.formats)) + " |")
    return "\n".join(lines) + "\n"


def _cell(value, fmt: str) -> str:
    if value is None:
        return "-"
    if fmt == "":
        return str(value)
    if fmt == "us":
        return f"{value:.1f}" if abs(value) >= 1 else f"{value:.3f}"
    if fmt == "x":
        return f"{value:.2f}x"
    if fmt == "pct":
        return f"{value * 100:+.0f}%"
    if fmt == "gbs":
        return f"{value:.4g}"
    return format(int(value), "d") if fmt == "d" else format(value, fmt)


def _csv(table: t.Table) -> str:
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(table.columns)
    for row in table.rows:
        writer.writerow(["" if v is None else f"{v:.6g}" if isinstance(v, float) else v for v in row])
    return buf.getvalue()
