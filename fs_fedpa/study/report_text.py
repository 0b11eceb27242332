"""How the SST-2 report prints its numbers; shared by :mod:`fs_fedpa.study.report` and its privacy section."""

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
