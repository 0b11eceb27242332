"""The SST-2 protocol's verdict across settings, from the committed run files (no torch, no FS):

- :func:`split_analysis`: FedPA-LoRA − FedIT on each client split of the ``splits`` stage (per split: the paired t
  interval over seeds and the sign of each seed), across splits the t interval on the split means (new splits) and
  the fixed-split interval (these splits), and the one-way random-effects estimate of the split's share of the
  variance (:mod:`research.study.stats`); :func:`across_split_rows`: the stage's comparisons, one Holm family;
- :func:`deployment_rows`: the question of a user who deploys one model per client, "which model do I give client
  i": FedPA-LoRA's own adapter against FedIT's global adapter with the client's local head, and each method's two
  models against each other, fixed pairs by seed across the two evaluation protocols;
- :func:`family_rows`: a stage table's rows against their references, one Holm family;
- :func:`verdict_rows`: one row per setting and baseline, FedPA-LoRA − baseline under both protocols with its Holm
  label, for ``verdict.png`` (:func:`research.study.plots.plot_verdict`).

Holm's correction is applied to one family per table and protocol: every comparison of that table made under that
protocol; a table whose comparisons cross the protocols (the deployment table, the across-split comparisons) is one
family. Every label, in every table and in the figure, comes from :func:`research.study.protocol_results.with_holm`.
"""

from __future__ import annotations

import statistics

from research.study import stats
from research.study import protocol_results as pr
from research.study import sst2_protocol as sp

METRICS = ("val_acc", "local.val_acc")  # the paper protocol (global factors + local head), the clients' own factors


# ------------------------------------------------------------------------------------------------ client splits
def split_values(results: dict, method: str, beta: float, metric: str) -> dict[int, dict[int, float]]:
    """split seed -> training seed -> the final-round ``metric`` of ``method`` at ``beta``, over
    :func:`~research.study.sst2_protocol.split_seeds` and each split's training seeds (the committed split's runs come
    from ``final`` and ``beta``, whose extra seeds 3-4 are left out so that those splits have the same seeds)."""
    out: dict[int, dict[int, float]] = {}
    for split in sp.split_seeds(beta):
        for seed in sp.split_training_seeds(split):
            run = results.get(sp.splits_key(method, beta, split, seed))
            if run is not None and (value := pr.final_metric(run, metric)) is not None:
                out.setdefault(split, {})[seed] = value
    return out


def split_differences(results: dict, beta: float, metric: str, theirs: str | None = None,
                      splits: tuple[int, ...] | None = None) -> dict[int, list[float]]:  # fmt: skip
    """split seed -> the paired differences FedPA-LoRA's ``metric`` − FedIT's ``theirs`` (default: the same
    metric) over the seeds both ran on that split; over ``splits`` only where given (e.g. issue 41's three)."""
    ours = split_values(results, sp.SPLITS_ARMS[0], beta, metric)
    other = split_values(results, sp.SPLITS_ARMS[1], beta, theirs or metric)
    out = {}
    for split in splits or sp.split_seeds(beta):
        seeds = sorted(set(ours.get(split, {})) & set(other.get(split, {})))
        if seeds:
            out[split] = [ours[split][s] - other[split][s] for s in seeds]
    return out


def split_analysis(results: dict, beta: float, metric: str, theirs: str | None = None,
                   splits: tuple[int, ...] | None = None) -> dict:  # fmt: skip
    """Per split: n, mean, the paired t interval (n >= 2), its verdict and how many seeds FedPA-LoRA is ahead in.
    Across the splits that have at least 2 seeds (at least 2 such splits): ``"across"``, the t interval on the split
    means (:func:`research.study.stats.split_means_interval`: generalises to new splits), ``"fixed"``, the fixed-split
    interval (these splits only), and the split's variance component (:func:`research.study.stats.split_variance`).
    ``splits``: only these split seeds (default: every split of the stage at ``beta``)."""
    differences = split_differences(results, beta, metric, theirs, splits)
    per_split = {}
    for split, d in differences.items():
        row = {
            "n": len(d),
            "mean": statistics.fmean(d),
            "ahead": sum(x > 0 for x in d),
            "behind": sum(x < 0 for x in d),
        }
        if len(d) >= 2:
            _, low, high = stats.paired_interval(d)
            row.update(low=low, high=high, verdict=stats.verdict(low, high))
        per_split[split] = row
    out: dict = {"beta": beta, "metric": metric, "splits": per_split}
    full = {split: d for split, d in differences.items() if len(d) >= 2}
    if len(full) >= 2:
        across = stats.split_means_interval(full)
        out["across"] = {**across, "verdict": stats.verdict(across["low"], across["high"])}
        fixed = stats.fixed_split_interval(full)
        out["fixed"] = {**fixed, "verdict": stats.verdict(fixed["low"], fixed["high"])}
        out["variance"] = stats.split_variance(full)
    return out


ACROSS_SPLITS = (  # label, beta, FedPA-LoRA's metric, FedIT's metric: one Holm family (issue 57, fixed before its runs)
    ("β = 0.5, paper protocol", 0.5, "val_acc", "val_acc"),
    ("β = 0.5, own factors", 0.5, "local.val_acc", "local.val_acc"),
    ("β = 0.1, paper protocol", 0.1, "val_acc", "val_acc"),
    ("β = 0.1, own factors", 0.1, "local.val_acc", "local.val_acc"),
    ("β = 0.1, FedPA-LoRA own adapter − FedIT global adapter with the local head", 0.1, "local.val_acc", "val_acc"),
)


def across_split_rows(results: dict) -> dict[str, dict]:
    """label -> the across-split comparison of :data:`ACROSS_SPLITS` (:func:`split_analysis`'s ``"across"`` row,
    with ``"fixed"`` and ``"splits"`` beside it), labelled by Holm over the comparisons that have runs: one family."""
    family, fixed = {}, {}
    for label, beta, ours, theirs in ACROSS_SPLITS:
        found = split_analysis(results, beta, ours, theirs)
        if "across" in found:
            family[label] = found["across"]
            fixed[label] = found["fixed"]
    return {label: {**row, "fixed": fixed[label]} for label, row in pr.with_holm(family).items()}


# ------------------------------------------------------------------------------------------------ deployment
DEPLOYMENT = (  # label, (cell, metric) − (cell, metric); the cells are each setting's FedPA-LoRA and FedIT
    ("FedPA-LoRA own adapter − FedIT global adapter with the local head", ("fedpa", "local.val_acc"),
     ("fedit", "val_acc")),
    ("FedPA-LoRA: own adapter − global adapter with the local head", ("fedpa", "local.val_acc"),
     ("fedpa", "val_acc")),
    ("FedIT: own adapter − global adapter with the local head", ("fedit", "local.val_acc"), ("fedit", "val_acc")),
)  # fmt: skip
DEPLOYMENT_SETTINGS = (  # label, stage, FedPA-LoRA's cell, FedIT's cell, per-run value
    ("main cell, 21 rounds", "final", "fedpa", "fedit", pr.final_metric),
    ("β = 0.1, 21 rounds", "beta", "fedpa_beta0.1", "fedit_beta0.1", pr.final_metric),
    ("β = 100, 21 rounds", "beta", "fedpa_beta100", "fedit_beta100", pr.final_metric),
    ("long horizon, 60 rounds (mean of the last 3 evaluations)", "long", "fedpa", "fedit", sp.endpoint),
    ("partial participation, 100 clients, 60 rounds", "partial", "fedpa", "fedit", pr.final_metric),
)


def deployment_rows(results: dict) -> list[tuple[str, str, dict]]:
    """``(setting, comparison, row)`` for every setting of :data:`DEPLOYMENT_SETTINGS` with runs and every
    comparison of :data:`DEPLOYMENT`: the paired t row over the seeds both sides share, with its Holm label over
    the whole table (one family: its comparisons cross the protocols)."""
    family = {}
    for setting, stage, fedpa, fedit, value in DEPLOYMENT_SETTINGS:
        cells = {"fedpa": fedpa, "fedit": fedit}
        for label, (a, metric_a), (b, metric_b) in DEPLOYMENT:
            first = pr.cell_values(results, metric_a, stage, value).get(cells[a], {})
            second = pr.cell_values(results, metric_b, stage, value).get(cells[b], {})
            row = pr.paired_rows({}, "", ours="first", cells={"first": first, "second": second}).get("second")
            if row is not None:
                family[(setting, label)] = row
    labelled = pr.with_holm(family)
    return [(setting, label, labelled[(setting, label)]) for setting, label in family]


# ------------------------------------------------------------------------------------------------ the tables
def family_rows(results: dict, values: dict, pairs: dict[str, str], metric: str) -> dict[str, dict]:
    """Per cell of a stage, its paired row against its reference ``pairs[cell]``; every row of the table (under one
    protocol, ``metric``) is one family for Holm's correction, whatever its reference."""
    family: dict[str, dict] = {}
    for cell, ours in pairs.items():
        if ours and ours != cell and ours in values and cell in values:
            cells = {ours: values[ours], cell: values[cell]}
            if row := pr.paired_rows(results, metric, ours=ours, cells=cells).get(cell):
                family[cell] = row
    return pr.with_holm(family)


def beta_pairs(results: dict) -> dict[str, str]:
    """Each cell of the β stage -> FedPA-LoRA's cell at the same β (``fedit_beta0.1`` -> ``fedpa_beta0.1``)."""
    cells = [r["cell"] for k, r in results.items() if k.startswith("beta/")]
    return {c: f"fedpa_beta{c.rsplit('_beta', 1)[1]}" for c in cells}


def hetero_pairs(results: dict) -> dict[str, str]:
    """Each cell of the heterogeneous-rank stage -> FedPA-LoRA's cell there."""
    return {r["cell"]: "fedpa_r2_4_16" for k, r in results.items() if k.startswith("hetero/")}


# ------------------------------------------------------------------------------------------------ the figure
def verdict_rows(results: dict) -> list[dict]:
    """One row per setting and baseline for ``verdict.png``: ``{"setting", "against", metric: row with "holm"}``,
    FedPA-LoRA (or one of its arms) − the baseline, each labelled by its own table's Holm family."""
    rows: list[dict] = []

    def add(setting: str, by_metric: dict[str, dict[str, dict]], names: dict | None = None) -> None:
        for cell in dict.fromkeys(c for m in METRICS for c in by_metric.get(m, {})):
            entry = {"setting": setting, "against": (names or {}).get(cell, cell)}
            entry.update({m: by_metric[m][cell] for m in METRICS if cell in by_metric.get(m, {})})
            rows.append(entry)

    add("main cell (final runs)", {m: pr.with_holm(pr.paired_rows(results, m)) for m in METRICS})
    table = beta_pairs(results)
    labelled = {m: family_rows(results, pr.cell_values(results, m, "beta"), table, m) for m in METRICS}
    for beta in ("0.1", "100"):
        mine = {m: {c: row for c, row in labelled[m].items() if c.endswith(f"_beta{beta}")} for m in METRICS}
        add(f"β = {beta}", mine, {c: c.rsplit("_beta", 1)[0] for c in table})
    hetero = hetero_pairs(results)
    add("r_i ∈ {2, 4, 16}",
        {m: family_rows(results, pr.cell_values(results, m, "hetero"), hetero, m) for m in METRICS},
        {c: c.replace("_r2_4_16", "") for c in hetero})  # fmt: skip
    heads = {m: head_intervals(results, m) for m in METRICS}
    names = {label: label.split(" − ")[0] + " − FedIT" for label, *_ in HEAD_COMPARISONS[:2]}
    add("FedIT without a local head", {m: {k: v for k, v in heads[m].items() if k in names} for m in METRICS}, names)
    long_rows = {m: long_intervals(results, m) for m in METRICS}
    add("long horizon, 60 rounds (arm − FedIT)", long_rows, {c: f"arm {c}" for c in long_rows["val_acc"]})
    partial = partial_intervals(results)
    add("partial participation (arm − baseline)", partial, {k: f"{k[0]} − {k[1]}" for k in partial["val_acc"]})
    across = across_split_rows(results)
    for beta in sp.SPLITS_BETAS:
        by_metric = {m: {"fedit": across[label]} for label, b, m, theirs in ACROSS_SPLITS
                     if b == beta and m == theirs and label in across}  # fmt: skip
        if by_metric:
            k = next(iter(by_metric.values()))["fedit"]["splits"]
            add(f"β = {beta:g} across client splits (t on {k} split means)", by_metric)
    return rows


# The headline: FedPA-LoRA − FedIT in each main setting, under the paper's protocol, by a plain label:
# (the label, verdict_rows' setting, its "against")
HEADLINE = (
    ("10 clients, β = 0.5 (main)", "main cell (final runs)", "fedit"),
    ("β = 0.5, over 3 client splits", "β = 0.5 across client splits (t on 3 split means)", "fedit"),
    ("β = 0.1 (near one label each)", "β = 0.1", "fedit"),
    ("β = 0.1, over 8 client splits", "β = 0.1 across client splits (t on 8 split means)", "fedit"),
    ("β = 100 (near IID)", "β = 100", "fedit"),
    ("60 rounds instead of 21", "long horizon, 60 rounds (arm − FedIT)", "arm fedpa"),
    ("10 of 100 clients a round, 60 rounds", "partial participation (arm − baseline)", "fedpa − fedit"),
    ("both without a local head", "FedIT without a local head", "FedPA-LoRA without head − FedIT"),
)


def headline_rows(results: dict) -> list[dict]:
    """``headline.png``'s rows: ``{"label", "val_acc": row}`` for each of :data:`HEADLINE` the results hold."""
    rows = {(r["setting"], r["against"]): r for r in verdict_rows(results) if "val_acc" in r}
    return [{"label": label, "val_acc": rows[(setting, against)]["val_acc"]} for label, setting, against in HEADLINE
            if (setting, against) in rows]  # fmt: skip


HEAD_COMPARISONS = (  # label, (stage, cell) minus (stage, cell)
    ("FedPA-LoRA (local head) − FedIT without head", ("final", "fedpa"), ("head", sp.HEAD_CELL)),
    ("FedPA-LoRA without head − FedIT without head", ("ablation", "fedpa_no_local_head"), ("head", sp.HEAD_CELL)),
    ("FedIT (local head) − FedIT without head: the head's worth to FedIT", ("final", "fedit"), ("head", sp.HEAD_CELL)),
)


def head_intervals(results: dict, metric: str) -> dict[str, dict]:
    """The head asymmetry's :data:`HEAD_COMPARISONS` under one protocol, Holm over the three."""
    family = {}
    for label, (stage_a, a), (stage_b, b) in HEAD_COMPARISONS:
        first = pr.cell_values(results, metric, stage_a).get(a, {})
        second = pr.cell_values(results, metric, stage_b).get(b, {})
        if row := pr.paired_rows(results, metric, ours="first", cells={"first": first, b: second}).get(b):
            family[label] = row
    return pr.with_holm(family)


def long_intervals(results: dict, metric: str) -> dict[str, dict]:
    """Each FedPA-LoRA arm of the long horizon − FedIT, on the endpoint (:func:`sp.endpoint`), Holm over the arms of
    one protocol."""
    ends = pr.cell_values(results, metric, "long", sp.endpoint)
    family = {}
    for cell in ends:
        pair = {cell: ends[cell], "reference": ends.get(sp.LONG_REFERENCE, {})}
        if cell != sp.LONG_REFERENCE and (row := pr.paired_rows({}, metric, ours=cell, cells=pair).get("reference")):
            family[cell] = row
    return pr.with_holm(family)


def partial_intervals(results: dict) -> dict[str, dict]:
    """metric -> (FedPA-LoRA arm, baseline) -> its row, Holm over the whole table under one protocol."""
    ours = [name for name, method, _ in sp.PARTIAL_ARMS if method == "fedpa"]
    others = [name for name, method, _ in sp.PARTIAL_ARMS if method != "fedpa"]
    out = {}
    for m in METRICS:
        values = pr.cell_values(results, m, "partial")
        family = {}
        for arm in ours:
            cells = {c: values[c] for c in (arm, *others) if c in values}
            for other, row in pr.paired_rows(results, m, ours=arm, cells=cells).items():
                family[(arm, other)] = row
        out[m] = pr.with_holm(family)
    return out
