"""GLUE metrics in numpy (no download at run time): accuracy, binary F1, Matthews correlation, Pearson, Spearman."""

from __future__ import annotations

import numpy as np


def _pair(y_true, y_pred) -> tuple[np.ndarray, np.ndarray]:
    a, b = np.asarray(y_true).reshape(-1), np.asarray(y_pred).reshape(-1)
    if a.size == 0 or a.size != b.size:
        raise ValueError(f"need equally long, non-empty y_true and y_pred, got {a.size} and {b.size}")
    return a, b


def accuracy(y_true, y_pred) -> float:
    a, b = _pair(y_true, y_pred)
    return float(np.mean(a == b))


def f1_binary(y_true, y_pred, positive: int = 1) -> float:
    """F1 of the positive class (GLUE's F1 for MRPC/QQP); 0.0 when there is no true or predicted positive."""
    a, b = _pair(y_true, y_pred)
    tp = float(np.sum((a == positive) & (b == positive)))
    fp = float(np.sum((a != positive) & (b == positive)))
    fn = float(np.sum((a == positive) & (b != positive)))
    return 0.0 if tp == 0 else 2 * tp / (2 * tp + fp + fn)


def matthews_corr(y_true, y_pred) -> float:
    """Matthews correlation (multiclass form, Gorodkin 2004); 0.0 when undefined (a constant prediction)."""
    a, b = _pair(y_true, y_pred)
    classes = np.union1d(a, b)
    C = np.array([[np.sum((a == i) & (b == j)) for j in classes] for i in classes], dtype=np.float64)
    t, p, c, s = C.sum(1), C.sum(0), np.trace(C), C.sum()
    denominator = np.sqrt(s**2 - p @ p) * np.sqrt(s**2 - t @ t)
    return 0.0 if denominator == 0 else float((c * s - t @ p) / denominator)


def pearson(x, y) -> float:
    a, b = _pair(x, y)
    if np.ptp(a) == 0 or np.ptp(b) == 0:  # constant: its mean may differ from it by rounding, which is no signal
        return 0.0
    a, b = a.astype(np.float64) - a.mean(), b.astype(np.float64) - b.mean()
    # rescale first: products of tiny deviations (e.g. 1e-203) would underflow to 0
    a, b = (v / np.abs(v).max() if np.abs(v).max() > 0 else v for v in (a, b))
    denominator = np.sqrt((a @ a) * (b @ b))
    return 0.0 if denominator == 0 else float(a @ b / denominator)


def spearman(x, y) -> float:
    a, b = _pair(x, y)
    return pearson(_ranks(a), _ranks(b))


def _ranks(v: np.ndarray) -> np.ndarray:
    """Ranks with ties averaged (as scipy.stats.rankdata)."""
    order = np.argsort(v, kind="mergesort")
    ranks = np.empty(len(v), dtype=np.float64)
    ranks[order] = np.arange(1, len(v) + 1)
    _, inverse, counts = np.unique(v, return_inverse=True, return_counts=True)
    sums = np.bincount(inverse, weights=ranks)
    return (sums / counts)[inverse]


def glue_metrics(task: str, y_true, y_pred) -> dict[str, float]:
    """GLUE's metric(s) of a task: class indices for classification, scores for STS-B."""
    from fs_fedpa.tasks.glue import get_task

    metric = get_task(task).metric
    if metric == "accuracy":
        return {"acc": accuracy(y_true, y_pred)}
    if metric == "accuracy_f1":
        return {"acc": accuracy(y_true, y_pred), "f1": f1_binary(y_true, y_pred)}
    if metric == "matthews":
        return {"mcc": matthews_corr(y_true, y_pred)}
    return {"pearson": pearson(y_true, y_pred), "spearman": spearman(y_true, y_pred)}
