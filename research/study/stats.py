"""The statistics of a tuned comparison, without torch or FS: the pilot's stopping round, the selection of
hyper-parameters on held-out validation data, paired confidence intervals between methods, Holm's correction for
a family of them, a paired bootstrap over seeds and sentences, the false-positive rate of the seed rule, and the
across-split intervals (t on the split means; the fixed-split interval) with the split's variance component.

Used by :mod:`research.study.sst2_protocol` (docs/study/sst2_protocol.md). The t tests, t and F quantiles come
from scipy and Holm's correction from statsmodels. Kept by hand: the protocol's own rules (plateau, selection, seed
rule), the crossed bootstrap (scipy's resamples one axis, not seeds x sentences within clients) and the ANOVA
moments with the fixed-split interval (scipy's ``f_oneway`` returns neither the mean squares nor the components).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Mapping, Sequence


def t_quantile_975(df: int) -> float:
    """t_{0.975, df}: the half-width factor of a two-sided 95% interval with ``df`` degrees of freedom."""
    from scipy import stats

    if df < 1:
        raise ValueError(f"a t interval needs df >= 1, got {df}")
    return float(stats.t.ppf(0.975, df))


def plateau_round(curve: Mapping[int, float], gain: float = 0.005, window: float = 0.25, min_rounds: int = 8) -> int:
    """The round T at which ``curve`` (FS round index -> validation accuracy) stops improving: the first evaluated
    round t >= ``min_rounds`` whose best-so-far accuracy exceeds the best-so-far at round ``(1 - window) * t`` by
    less than ``gain``; the last evaluated round if there is none (not converged).

    FS logs rounds from 0 (the evaluation at index t follows t + 1 rounds of training); the SST-2 protocol takes the
    index T returned here as its number of rounds, so its runs train T rounds, one fewer than the pilot had at T.
    The best-so-far curve ignores one low evaluation, but one high evaluation holds it up for every later round and
    can stop the rule early: :func:`plateau_round_smoothed` cannot be triggered so."""
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
    return _one_sample_t(differences)[:3]


def verdict(low: float, high: float) -> str:
    """ "wins" if the whole interval of (ours - theirs) is above 0, "loses" if below, else "ties"."""
    return "wins" if low > 0 else "loses" if high < 0 else "ties"


# ------------------------------------------------------------------------------------------ issue 31's additions
def moving_average(curve: Mapping[int, float], k: int = 3) -> dict[int, float]:
    """The trailing mean of ``k`` consecutive evaluations, at every evaluated round from the ``k``-th on:
    ``{t_i: mean(curve[t_{i-k+1}], ..., curve[t_i])}``."""
    if k < 1:
        raise ValueError(f"a moving average needs k >= 1, got {k}")
    rounds = sorted(curve)
    return {
        rounds[i]: statistics.fmean(curve[t] for t in rounds[i - k + 1 : i + 1]) for i in range(k - 1, len(rounds))
    }


def plateau_round_smoothed(curve: Mapping[int, float], k: int = 3, **rule) -> int:
    """:func:`plateau_round` on the :func:`moving_average` of ``k`` evaluations: one high evaluation lifts the
    average by a ``k``-th of its excess only, so it cannot by itself hold the best-so-far above the later rounds."""
    smoothed = moving_average(curve, k)
    if not smoothed:
        raise ValueError(f"the pilot has fewer than k = {k} evaluated rounds")
    return plateau_round(smoothed, **rule)


def paired_t_p(differences: Sequence[float]) -> float:
    """The two-sided p-value of the paired t test of mean 0 (the test behind :func:`paired_interval`): 1 where all
    differences are 0, 0 where they are equal and not 0."""
    n = len(differences)
    if n < 2:
        raise ValueError(f"a paired t test needs at least 2 paired runs, got {n}")
    return _one_sample_t(differences)[3]


def _one_sample_t(values: Sequence[float]) -> tuple[float, float, float, float]:
    """``(mean, low, high, p)``: scipy's one-sample t test of mean 0 and its 95% interval. Equal values are answered
    exactly (an interval of width 0; p 1 at 0, else 0): scipy's moments lose all precision on them."""
    from scipy import stats

    mean = statistics.fmean(values)
    if len(set(values)) == 1:
        return mean, mean, mean, 1.0 if mean == 0 else 0.0
    result = stats.ttest_1samp(values, 0.0)
    interval = result.confidence_interval(0.95)
    return mean, float(interval.low), float(interval.high), float(result.pvalue)


def holm(pvalues: Mapping[str, float]) -> dict[str, float]:
    """Holm's step-down adjusted p-values of one family of ``m`` tests: the i-th smallest p becomes
    max_{j <= i} min(1, (m - j + 1) p_(j)). Rejecting where the adjusted p < α keeps the chance of any false
    rejection in the family at most α, whatever the dependence between the tests."""
    from statsmodels.stats.multitest import multipletests

    if not pvalues:
        return {}
    adjusted = multipletests(list(pvalues.values()), method="holm")[1]
    return {key: float(p) for key, p in zip(pvalues, adjusted)}


def holm_verdicts(rows: Mapping[str, Mapping], alpha: float = 0.05) -> dict[str, str]:
    """Per row of one family (``{"mean", "p"}``): wins / loses by the sign of its mean where its Holm-adjusted p is
    below ``alpha``, else ties."""
    adjusted = holm({key: row["p"] for key, row in rows.items()})
    return {
        key: ("ties" if adjusted[key] >= alpha else "wins" if row["mean"] > 0 else "loses")
        for key, row in rows.items()
    }


def paired_bootstrap(
    x: Sequence[Sequence[float]],
    y: Sequence[Sequence[float]],
    strata: Sequence[int],
    draws: int = 10_000,
    seed: int = 0,
    paired: bool = True,
) -> tuple[float, float, float]:
    """``(mean, low, high)``: the estimate and the 95% percentile interval of mean_s mean_j (x[s][j] - y[s][j]).

    ``x[s][j]``: arm X's score of sentence j in seed s (e.g. the share of the last evaluations that got it right);
    ``strata[j]``: the client whose shard holds sentence j. Sentences and seeds are crossed (every seed scores every
    sentence), so each draw resamples the seeds with replacement and, independently, the sentences with
    replacement within each client's shard, one draw of sentences for all the seeds it holds: a hard sentence is
    hard in every seed. ``paired``: the two arms share each draw (the design); False resamples them independently,
    the interval that ignores the pairing."""
    import numpy as np

    X, Y = np.asarray(x, dtype=np.float64), np.asarray(y, dtype=np.float64)
    groups = np.asarray(strata)
    if X.shape != Y.shape or X.ndim != 2 or X.shape[1] != len(groups):
        raise ValueError(f"x and y must be (seeds, sentences) with one stratum per sentence: {X.shape}, {Y.shape}")
    rng = np.random.default_rng(seed)
    n_seeds, n = X.shape
    members = [np.flatnonzero(groups == g) for g in np.unique(groups)]

    def sentence_counts() -> np.ndarray:  # (draws, n): how often each sentence is drawn
        counts = np.zeros((draws, n))
        rows = np.arange(draws)[:, None]
        for idx in members:
            picks = idx[rng.integers(0, len(idx), size=(draws, len(idx)))]
            np.add.at(counts, (np.broadcast_to(rows, picks.shape), picks), 1.0)
        return counts

    def seed_counts() -> np.ndarray:  # (draws, seeds)
        picks = rng.integers(0, n_seeds, size=(draws, n_seeds))
        return np.stack([(picks == s).sum(1) for s in range(n_seeds)], axis=1).astype(np.float64)

    def replicate(scores: np.ndarray, sentences: np.ndarray, seeds: np.ndarray) -> np.ndarray:
        return (seeds * (sentences @ scores.T)).sum(1) / (n_seeds * n)

    if paired:
        sentences, seeds = sentence_counts(), seed_counts()
        reps = replicate(X - Y, sentences, seeds)
    else:
        reps = replicate(X, sentence_counts(), seed_counts()) - replicate(Y, sentence_counts(), seed_counts())
    low, high = np.percentile(reps, [2.5, 97.5])
    return float((X - Y).mean()), float(low), float(high)


def seed_rule_exclusions(
    sds: Sequence[float], first: int = 3, more: int = 2, sims: int = 20_000, seed: int = 0
) -> tuple[float, float]:
    """Under the null (every true difference 0), the protocol's 3-then-5 seed rule applied to comparisons whose
    paired differences are normal with the standard deviations ``sds``: ``first`` seeds; a comparison whose 95% t
    interval contains 0 gets ``more`` seeds and is judged again at ``first + more``. Returns the chance that one
    comparison ends with an interval that excludes 0, and the expected number of such spurious exclusions among
    ``len(sds)`` comparisons; a Monte Carlo of ``sims`` draws with a fixed ``seed``."""
    import numpy as np

    rng = np.random.default_rng(seed)
    sd = np.asarray(sds, dtype=np.float64)
    d = rng.standard_normal((sims, len(sd), first + more)) * sd[None, :, None]

    def excludes(sample: np.ndarray) -> np.ndarray:
        k = sample.shape[-1]
        half = t_quantile_975(k - 1) * sample.std(-1, ddof=1) / math.sqrt(k)
        return np.abs(sample.mean(-1)) > half

    early = excludes(d[..., :first])
    spurious = early | (~early & excludes(d))
    return float(spurious.mean()), float(spurious.sum(1).mean())


# ------------------------------------------------------------------------------------------ issue 41's additions
def _groups(differences: Mapping[object, Sequence[float]]) -> list[list[float]]:
    groups = [list(map(float, values)) for values in differences.values()]
    if len(groups) < 2 or any(len(g) < 1 for g in groups):
        raise ValueError(f"needs at least 2 splits with at least 1 paired difference each, got {len(groups)} splits")
    return groups


def split_means_interval(differences: Mapping[object, Sequence[float]]) -> dict[str, float]:
    """The across-split interval that generalises to new client splits: the t interval on the k split means
    m_j = mean_s d_{js} (ours − theirs on split j, seed s), k − 1 degrees of freedom:

        m̄ ± t_{0.975, k−1} · sd(m_1..m_k) / sqrt(k),   p = 2 P(T_{k−1} > |m̄| / (sd / sqrt(k))).

    Under d_{js} = μ + a_j + e_{js} with a_j ~ N(0, σ²_split), e_{js} ~ N(0, σ²_seed) and balanced splits, the m_j are
    iid N(μ, σ²_split + σ²_seed / n), so the interval is exact whatever the ratio of the two variances (in a balanced
    design it equals REML with Kenward–Roger degrees of freedom where the split component is positive). Returns
    ``{"mean", "low", "high", "p", "df", "splits"}``."""
    means = [statistics.fmean(g) for g in _groups(differences)]
    mean, low, high, p = _one_sample_t(means)
    return {"mean": mean, "low": low, "high": high, "p": p, "df": len(means) - 1, "splits": len(means)}


def fixed_split_interval(differences: Mapping[object, Sequence[float]]) -> dict[str, float]:
    """The interval for these splits only (the split taken as a fixed effect): the mean of the split means, with the
    within-split mean square as the error, N − k degrees of freedom:

        m̄ ± t_{0.975, N−k} · sqrt(MS_within · Σ_j 1/n_j) / k,   MS_within = Σ_j Σ_s (d_{js} − m_j)² / (N − k).

    It says nothing about a new split: where splits differ it undercovers the mean over splits. Returns
    ``{"mean", "low", "high", "p", "df"}``."""
    groups = _groups(differences)
    k, total = len(groups), sum(len(g) for g in groups)
    if total <= k:
        raise ValueError("needs a split with at least 2 paired differences: the within-split variance is unidentified")
    means = [statistics.fmean(g) for g in groups]
    ms_within = sum((x - m) ** 2 for g, m in zip(groups, means) for x in g) / (total - k)
    mean = statistics.fmean(means)
    se = math.sqrt(ms_within * sum(1 / len(g) for g in groups)) / k
    half = t_quantile_975(total - k) * se
    return {"mean": mean, "low": mean - half, "high": mean + half, "p": _t_p(mean, se, total - k), "df": total - k}


def _t_p(mean: float, se: float, df: int) -> float:
    """Two-sided p of a t statistic mean / se with ``df`` degrees of freedom (1 where both are 0, 0 where se is 0)."""
    from scipy import stats

    if se == 0:
        return 1.0 if mean == 0 else 0.0
    return float(2 * stats.t.sf(abs(mean) / se, df))


def split_variance(differences: Mapping[object, Sequence[float]]) -> dict[str, float]:
    """The one-way random-effects decomposition d_{js} = μ + a_j + e_{js} of paired differences by client split j
    (a_j ~ (0, σ²_split), e_{js} ~ (0, σ²_seed)), by the ANOVA method of moments:

    MS_between = Σ_j n_j (d̄_j − d̄)² / (k − 1), MS_within = Σ_j Σ_s (d_{js} − d̄_j)² / (N − k),
    σ²_seed = MS_within, σ²_split = max(0, (MS_between − MS_within) / n_0), n_0 = (N − Σ n_j² / N) / (k − 1).

    Returns those with ``df_between`` = k − 1, ``df_within`` = N − k, F = MS_between / MS_within, its p-value for
    σ²_split = 0 and, for balanced splits, the exact 95% interval of the ratio σ²_split / σ²_seed,
    [(F / F_{0.975} − 1) / n, (F / F_{0.025} − 1) / n] clipped at 0 (F quantiles at those df)."""
    from scipy import stats

    groups = _groups(differences)
    k, sizes = len(groups), [len(g) for g in groups]
    total = sum(sizes)
    if total <= k:
        raise ValueError("needs a split with at least 2 paired differences: the seed variance is unidentified")
    grand = statistics.fmean(x for g in groups for x in g)
    means = [statistics.fmean(g) for g in groups]
    ms_between = sum(n * (m - grand) ** 2 for n, m in zip(sizes, means)) / (k - 1)
    ms_within = sum((x - m) ** 2 for g, m in zip(groups, means) for x in g) / (total - k)
    n0 = (total - sum(n * n for n in sizes) / total) / (k - 1)
    df1, df2 = k - 1, total - k
    out = {
        "splits": k,
        "runs": total,
        "df_between": df1,
        "df_within": df2,
        "ms_between": ms_between,
        "ms_within": ms_within,
        "var_seed": ms_within,
        "var_split": max(0.0, (ms_between - ms_within) / n0),
    }
    if ms_within == 0:
        return out
    F = ms_between / ms_within
    out.update(F=F, p=float(stats.f.sf(F, df1, df2)))
    if len(set(sizes)) == 1:
        n = sizes[0]
        low = (F / stats.f.ppf(0.975, df1, df2) - 1) / n
        high = (F / stats.f.ppf(0.025, df1, df2) - 1) / n
        out.update(ratio_low=max(0.0, float(low)), ratio_high=max(0.0, float(high)))
    return out
