"""The report's PNG plots, rendered byte for byte the same from the same numbers.

matplotlib's Agg backend draws deterministically; the PNG's only varying metadata (the Software
key naming matplotlib's version) is left out, fonts and sizes are fixed here.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

STYLE = {"font.size": 8, "axes.titlesize": 9, "legend.fontsize": 7, "figure.dpi": 100, "savefig.dpi": 100,
         "font.family": "DejaVu Sans", "axes.grid": True, "grid.alpha": 0.3}


def _figure(columns: int):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    plt.rcdefaults()
    plt.rcParams.update(STYLE)
    return plt, *plt.subplots(1, columns, figsize=(4.2 * columns, 3.2), squeeze=False)


def _save(plt, fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, format="png", metadata={"Software": None})
    plt.close(fig)
    return path


def cdf(path: Path, panels: Sequence[tuple[str, dict[str, Sequence[float]]]], xlabel: str) -> Path:
    """One panel per (title, {series label: percentiles 0..100 of the values}): the CDF of each series."""
    plt, fig, axes = _figure(len(panels))
    for ax, (title, series) in zip(axes[0], panels):
        for label, points in series.items():
            ax.plot(points, [100 * i / (len(points) - 1) for i in range(len(points))], label=label, linewidth=1.2)
        positive = all(v > 0 for points in series.values() for v in points)
        ax.set(title=title, xlabel=xlabel, ylabel="layers and iterations (%)", xscale="log" if positive else "linear")
        if positive:  # a log axis labels its minor ticks too, which overlap within one decade
            from matplotlib.ticker import NullFormatter

            ax.xaxis.set_minor_formatter(NullFormatter())
        ax.legend(loc="lower right")
    return _save(plt, fig, path)


def stacked_bars(path: Path, panels: Sequence[tuple[str, list[str], dict[str, list[float]]]], ylabel: str) -> Path:
    """One panel per (title, bar labels, {part: value per bar}): the parts stacked per bar."""
    plt, fig, axes = _figure(len(panels))
    for ax, (title, labels, parts) in zip(axes[0], panels):
        bottom = [0.0] * len(labels)
        for part, values in parts.items():
            ax.bar(range(len(labels)), values, bottom=bottom, label=part)
            bottom = [b + v for b, v in zip(bottom, values)]
        ax.set_xticks(range(len(labels)), labels, rotation=35, ha="right")
        ax.set(title=title, ylabel=ylabel)
        ax.legend()
    return _save(plt, fig, path)


def lines(path: Path, panels: Sequence[tuple[str, str, str, dict[str, tuple[Sequence[float], Sequence[float]]]]]) -> Path:
    """One panel per (title, xlabel, ylabel, {series label: (x, y)})."""
    plt, fig, axes = _figure(len(panels))
    for ax, (title, xlabel, ylabel, series) in zip(axes[0], panels):
        for label, (x, y) in series.items():
            ax.plot(x, y, marker="o", markersize=3, linewidth=1.2, label=label)
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.legend()
    return _save(plt, fig, path)
