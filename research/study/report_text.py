"""How the SST-2 report prints its numbers and notes; shared by every section (:mod:`research.study.report`)."""

from __future__ import annotations

import statistics


def pm(values: list[float]) -> str:
    """mean ± the sample standard deviation (n − 1 in the denominator) over ``values`` (n); one value: mean (1)."""
    if not values:
        return "–"
    if len(values) == 1:
        return f"{values[0]:.4f} (1)"
    return f"{statistics.fmean(values):.4f} ± {statistics.stdev(values):.4f} ({len(values)})"


def score(value: float | None) -> str:
    return "–" if value is None else f"{value:.4f}"


METRICS = ("val_acc", "local.val_acc")


METRIC_NAMES = {"val_acc": "paper protocol", "local.val_acc": "own factors"}


def interval(row: dict | None) -> str:
    if row is None:
        return "–"
    text = f"{row['mean']:+.4f} [{row['low']:+.4f}, {row['high']:+.4f}] n={row['seeds']}: FedPA {row['verdict']}"
    return text + (f"; Holm: {row['holm']} (p {row['holm_p']:.3f})" if "holm" in row else "")


HOLM_NOTE = (
    "Holm: the label after Holm's correction over one family, every comparison of the same table under the same "
    "protocol (paired t tests' p-values at the final n; the correction ignores the 3-then-5 seed rule, which adds its "
    "own chance of a spurious exclusion)."
)


SPREAD_NOTE = "mean ± sample standard deviation over seeds (n)"


def lr(row: dict) -> str:
    return f"{row['optimizer']} {row['lr']:g}" + (f", λ {row['lam']:g}" if row.get("lam") is not None else "")
