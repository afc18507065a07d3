"""The predictor metrics, defined once: every report, test and benchmark uses these functions.

- top-k hit rate: fraction of the actual top-k experts found in the predicted top-k, per token;
- load accuracy: 1 - 0.5 * L1 distance between predicted and actual normalised per-expert loads;
- Pearson correlation between predicted and actual per-expert loads;
- straggler precision: how often the predicted most-loaded expert is an actual most-loaded one.

Loads are per layer and batch (one forward call): arrays [..., E]; the last axis is experts.
"""

from __future__ import annotations

import numpy as np

METRICS = ("topk_hit", "load_acc", "pearson", "straggler")


def topk_hit_rate(pred_idx: np.ndarray, true_idx: np.ndarray) -> float:
    """Mean over tokens of |predicted top-k ∩ actual top-k| / k.

    pred_idx: [T, k'] int, true_idx: [T, k] int (usually k' = k). NaN when T = 0.
    """
    pred_idx, true_idx = np.asarray(pred_idx), np.asarray(true_idx)
    if pred_idx.ndim != 2 or true_idx.ndim != 2 or pred_idx.shape[0] != true_idx.shape[0]:
        raise ValueError(f"top-k hit rate needs [T, k] index arrays with equal T, got {pred_idx.shape} and {true_idx.shape}")
    if true_idx.shape[0] == 0:
        return float("nan")
    found = (true_idx[:, :, None] == pred_idx[:, None, :]).any(axis=2)  # [T, k]
    return float(found.mean())


def _shares(load: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(load / its sum over experts, that sum [..., 1]); all-zero loads stay zeros. Few numpy calls:
    the serving path scores every layer of every forward (predictor/runtime.py)."""
    if (load < 0).any():
        raise ValueError("loads must be non-negative token counts")
    total = load.sum(axis=-1, keepdims=True)
    return load / np.where(total > 0, total, 1.0), total


def load_accuracy(pred_load: np.ndarray, true_load: np.ndarray) -> np.ndarray:
    """1 - 0.5 * ||p/|p| - t/|t|||_1, in [0, 1]; 1 means the same load shares.

    pred_load, true_load: [..., E] -> [...]. A batch with no actual tokens scores NaN.
    """
    p, _ = _shares(np.asarray(pred_load, dtype=np.float64))
    t, total = _shares(np.asarray(true_load, dtype=np.float64))
    if p.shape != t.shape:
        raise ValueError(f"predicted and actual loads differ in shape: {p.shape} vs {t.shape}")
    acc = 1.0 - 0.5 * np.abs(p - t).sum(axis=-1)
    return np.where(total[..., 0] > 0, acc, np.nan)


def pearson(pred_load: np.ndarray, true_load: np.ndarray) -> np.ndarray:
    """Pearson correlation over experts: [..., E] x [..., E] -> [...].

    NaN where either side is constant (the correlation is undefined); aggregate with nanmean.
    """
    p = np.asarray(pred_load, dtype=np.float64)
    t = np.asarray(true_load, dtype=np.float64)
    if p.shape != t.shape:
        raise ValueError(f"predicted and actual loads differ in shape: {p.shape} vs {t.shape}")
    pc = p - p.mean(axis=-1, keepdims=True)
    tc = t - t.mean(axis=-1, keepdims=True)
    denom = np.sqrt((pc * pc).sum(axis=-1) * (tc * tc).sum(axis=-1))
    num = (pc * tc).sum(axis=-1)
    return np.divide(num, denom, out=np.full(num.shape, np.nan), where=denom > 0)


def straggler_hit(pred_load: np.ndarray, true_load: np.ndarray) -> np.ndarray:
    """1.0 where the predicted most-loaded expert is among the actual most-loaded ones, else 0.0.

    pred_load, true_load: [..., E] -> [...]. Ties in the prediction go to the lowest expert index
    (np.argmax); ties in the actual load all count as the straggler.
    """
    p = np.asarray(pred_load)
    t = np.asarray(true_load)
    if p.shape != t.shape:
        raise ValueError(f"predicted and actual loads differ in shape: {p.shape} vs {t.shape}")
    chosen = np.take_along_axis(t, np.argmax(p, axis=-1)[..., None], axis=-1)[..., 0]
    return (chosen == t.max(axis=-1)).astype(np.float64)


def summarise(pred_loads: np.ndarray, true_loads: np.ndarray, topk_hit: float | None = None) -> dict[str, float]:
    """The four metrics over B (layer, batch) cases: means of the per-case values.

    pred_loads, true_loads: [B, E]; topk_hit: the hit rate over all their tokens (topk_hit_rate of
    the concatenated indices), or None for load-only methods, reported as NaN.
    """
    with np.errstate(invalid="ignore"):
        acc, corr = load_accuracy(pred_loads, true_loads), pearson(pred_loads, true_loads)
    return {
        "topk_hit": float("nan") if topk_hit is None else float(topk_hit),
        "load_acc": _nanmean(acc),
        "pearson": _nanmean(corr),
        "straggler": float(np.mean(straggler_hit(pred_loads, true_loads))),
    }


def _nanmean(values: np.ndarray) -> float:
    """Mean of the defined values; NaN (without a warning) when none is defined."""
    values = np.asarray(values, dtype=np.float64)
    defined = values[~np.isnan(values)]
    return float(defined.mean()) if defined.size else float("nan")
