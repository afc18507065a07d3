"""Tables and the plot of predictor results (the benchmark's and `moeless predictor eval`'s)."""

from __future__ import annotations

from pathlib import Path

from moeless.predictor.metrics import METRICS

LABELS = {"topk_hit": "top-k hit", "load_acc": "load acc", "pearson": "Pearson", "straggler": "straggler P"}


def _cell(value: float) -> str:
    return "    -" if value != value else f"{value:5.3f}"  # NaN: the method has no such figure


def scores_table(scores: dict[str, dict[str, dict[str, float]]]) -> str:
    """scores[method][distance][metric] -> a fixed-width text table, one row per (method, d)."""
    lines = [f"{'method':<13} {'d':>2} " + " ".join(f"{LABELS[c]:>11}" for c in METRICS)]
    for method, by_d in scores.items():
        for d, row in by_d.items():
            lines.append(f"{method:<13} {d:>2} " + " ".join(f"{_cell(row[c]):>11}" for c in METRICS))
    return "\n".join(lines)


def bench_summary(result: dict) -> str:
    """The benchmark's figures as text: tables per dataset, memory, training, ratios at d = 1."""
    out = []
    for dataset, scores in result["scores"].items():
        out += [f"\n== {dataset} (held-out prompts) ==", scores_table(scores)]
    gate = result["gate_bytes"]
    out.append(f"\n== memory, and latency of one layer's forecast ({result['latency_tokens']} tokens, median) ==")
    for method, total in result["memory_bytes"].items():
        per = result["memory_per_layer_bytes"][method]
        ms = result["latency_ms_per_layer"][method]
        out.append(f"{method:<13} total {total / 2**20:8.2f} MiB   per layer {per / 1024:8.1f} KiB ({per / gate:5.2f}x one gate)   {ms:7.3f} ms/layer")
    out.append(f"\n== training == gate replicas {result['training_s']['gate_replica']:.1f} s, MLPs {result['training_s']['mlp']:.1f} s; {result['finetune']}")
    out.append("\n== gate_replica / baseline (1.18 = 18% better) ==")
    for dataset, bases in result["ratios"].items():
        for base, by_d in bases.items():
            cells = ", ".join(f"d={d}: " + " ".join(f"{LABELS[m]} {v:.3f}" for m, v in r.items()) for d, r in by_d.items())
            out.append(f"{dataset:<10} vs {base:<11} {cells}")
    return "\n".join(out)


def plot_scores(result: dict, path: str | Path) -> Path:
    """One panel per (dataset, metric): each method's metric against distance d; saved as PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    datasets = list(result["scores"])
    fig, axes = plt.subplots(len(datasets), len(METRICS), figsize=(4 * len(METRICS), 3.2 * len(datasets)), squeeze=False)
    for row, dataset in enumerate(datasets):
        for col, metric in enumerate(METRICS):
            ax = axes[row][col]
            for method, by_d in result["scores"][dataset].items():
                xs = [int(d) for d in by_d if by_d[d][metric] == by_d[d][metric]]
                if xs:
                    ax.plot(xs, [by_d[str(d)][metric] for d in xs], marker="o", label=method)
            ax.set_title(f"{dataset}: {LABELS[metric]}")
            ax.set_xlabel("distance d (layers ahead)")
            ax.grid(alpha=0.3)
    axes[0][1].legend(fontsize=8)  # load accuracy: the panel every method has a line in
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
