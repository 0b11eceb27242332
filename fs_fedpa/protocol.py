"""The statistics of a tuned comparison, without torch or FS: the pilot's stopping round, the selection of
hyper-parameters on held-out validation data, and paired confidence intervals between methods.

Used by :mod:`fs_fedpa.sst2_protocol` (the SST-2 protocol of docs/compare.md); every function is plain Python
so that the rules can be checked by hand.
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence

# Two-sided 95% quantiles t_{0.975, df} of Student's t, df = 1..30 (beyond: the normal quantile 1.96 is within 2%).
_T975 = (
    12.706204736, 4.302652730, 3.182446305, 2.776445105, 2.570581836, 2.446911851, 2.364624252, 2.306004135,
    2.262157163, 2.228138852, 2.200985160, 2.178812830, 2.160368656, 2.144786688, 2.131449546, 2.119905299,
    2.109815578, 2.100922040, 2.093024054, 2.085963447, 2.079613845, 2.073873068, 2.068657610, 2.063898562,
    2.059538553, 2.055529439, 2.051830516, 2.048407142, 2.045229642, 2.042272456,
)  # fmt: skip


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: the half-width factor of a two-sided 95% interval with ``df`` degrees of freedom."""
    if df < 1:
        raise ValueError(f"a t interval needs df >= 1, got {df}")
    return _T975[df - 1] if df <= len(_T975) else 1.959963985


def plateau_round(curve: Mapping[int, float], gain: float = 0.005, window: float = 0.25, min_rounds: int = 8) -> int:
    """The number of rounds T after which ``curve`` (rounds, 1-based -> validation accuracy) stops improving: the
    first evaluated round t >= ``min_rounds`` whose best-so-far accuracy exceeds the best-so-far at round
    ``(1 - window) * t`` by less than ``gain``; the last evaluated round if there is none (not converged).

    The best-so-far curve makes the rule insensitive to one noisy evaluation."""
    if not curve:
        raise ValueError("the pilot has no evaluated round")
    rounds = sorted(curve)
    best, running = {}, -math.inf
    for t in rounds:
        running = max(running, curve[t])
        best[t] = running

    def best_at(t: float) -> float:
        earlier = [s for s in rounds if s <= t]
        return best[earlier[-1]] if earlier else -math.inf

    for t in rounds:
        if t >= min_rounds and best[t] - best_at((1 - window) * t) < gain:
            return t
    return rounds[-1]


def select(rows: Sequence[Mapping], score: str = "score", group: str = "method") -> dict[str, Mapping]:
    """Per ``group``, the row with the largest ``score`` (rows without a score are ignored; the first row wins a
    tie, so a grid listed in a fixed order selects deterministically)."""
    best: dict[str, Mapping] = {}
    for row in rows:
        value = row.get(score)
        if value is None or (isinstance(value, float) and math.isnan(value)):
            continue
        key = row[group]
        if key not in best or value > best[key][score]:
            best[key] = row
    return best


def paired_interval(differences: Sequence[float]) -> tuple[float, float, float]:
    """``(mean, low, high)``: the two-sided 95% t interval of the mean of paired differences d_s = x_s - y_s (one per
    seed, the two runs sharing the seed's data split and initialisation): mean ± t_{0.975, n-1} · sd / sqrt(n)."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"a paired interval needs at least 2 paired runs, got {n}")
    mean = statistics.fmean(differences)
    half = t_quantile_975(n - 1) * statistics.stdev(differences) / math.sqrt(n)
    return mean, mean - half, mean + half


def verdict(low: float, high: float) -> str:
    """ "wins" if the whole interval of (ours - theirs) is above 0, "loses" if below, else "ties"."""
    return "wins" if low > 0 else "loses" if high < 0 else "ties"
