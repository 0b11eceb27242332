"""docs/compare.md's verdict and docs/study/sst2_protocol.md quote the SST-2 protocol's report: every interval and every
mean ± std they print must be one of the report's values rounded once, at the precision printed (no double rounding,
no stale number). The report's values are recomputed here from the committed run files."""

from __future__ import annotations

import itertools
import re
import statistics
from pathlib import Path

import pytest

from research.study import stats
from research.study import protocol_results as pr
from research.study import sst2_protocol as sp

ROOT = Path(__file__).resolve().parents[2]
NUMBER = r"([+−-]?\d+\.\d+)"
INTERVAL = re.compile(NUMBER + r" \[" + NUMBER + r", " + NUMBER + r"\]")
MEAN_STD = re.compile(r"(\d\.\d+) ± (\d\.\d+)")
STAGES = (
    "final", "beta", "hetero", "ablation", "adaptive", "head", "long", "partial", "privacy", "dpregime", "dpvalid",
    "dpfedpa",
)  # fmt: skip


def _section(path: Path, heading: str) -> str:
    text = path.read_text()
    start = text.index(heading)
    return text[start : text.index("\n## ", start + 1)]


def _protocol_section() -> str:
    """README's results, compare.md's verdict, the whole of sst2_protocol.md and what privacy.md measured: every
    place that quotes the protocol's report."""
    readme = _section(ROOT / "README.md", "## Results")
    verdict = (ROOT / "docs" / "study" / "verdict.md").read_text()
    privacy = (ROOT / "docs" / "study" / "privacy_measured.md").read_text()
    measured = privacy[privacy.index("## Measured") :]
    return "\n".join((readme, verdict, (ROOT / "docs" / "study" / "sst2_protocol.md").read_text(), measured))


def test_readmes_results_quote_the_report():
    """README's results section quotes intervals (each checked below against the report) and shows the verdict."""
    readme = _section(ROOT / "README.md", "## Results")
    assert len(INTERVAL.findall(readme)) >= 4
    assert "docs/reference/sst2_protocol/headline.png" in readme and "docs/reference/sst2_protocol/report.md" in readme


def _plain(number: str) -> str:
    return number.replace("−", "-").lstrip("+")


def _points(x: float, printed: str) -> str:
    decimals = len(printed.split(".")[1])
    text = f"{100 * x:.{decimals}f}"
    return "0." + "0" * decimals if text == "-0." + "0" * decimals else text


def _report_values() -> tuple[list[tuple[float, float, float]], list[tuple[float, float]]]:
    """Every paired interval (both directions) between two cells of a stage, the final runs and the ablation joined
    to every stage (the later stages compare against them), under both protocols; every cell's final mean and
    sample standard deviation (n - 1), as the report prints them."""
    results = pr.load_results(ROOT / sp.REPORT)
    intervals, spreads = [], []
    finals = {m: pr.cell_values(results, m, "final") for m in ("val_acc", "local.val_acc")}
    ablation = {m: pr.cell_values(results, m, "ablation") for m in ("val_acc", "local.val_acc")}
    for stage in STAGES:
        both = {}  # (metric, cell) -> seed -> value: the deployment table pairs cells across the protocols
        for metric in ("val_acc", "local.val_acc"):
            if stage == "long":
                cells: dict = {}
                for key, run in results.items():
                    if key.startswith("long/") and (v := sp.endpoint(run, metric)) is not None:
                        cells.setdefault(run["cell"], {})[run["seed"]] = v
            else:
                cells = pr.cell_values(results, metric, stage)
            joined = {**{f"final:{c}": v for c, v in finals[metric].items()}, **ablation[metric]}
            if stage == "dpfedpa":  # its finals pair with dpvalid's cells (FedIT under DP, FedPA-LoRA without DP)
                joined |= {f"dpvalid:{c}": v for c, v in pr.cell_values(results, metric, "dpvalid").items()}
            cells = {**joined, **cells}  # the head asymmetry pairs with the final runs and the ablation
            for values in cells.values():
                if len(values) > 1:
                    spreads.append((statistics.fmean(values.values()), statistics.stdev(values.values())))
            both.update({(metric, c): v for c, v in cells.items()})
        for a, b in itertools.permutations(both, 2):
            seeds = sorted(set(both[a]) & set(both[b]))
            if len(seeds) >= 2:
                intervals.append(stats.paired_interval([both[a][s] - both[b][s] for s in seeds]))
    intervals += [v for beta in sp.SPLITS_BETAS for m in ("val_acc", "local.val_acc")
                  for v in _split_values(results, beta, m).values()]  # fmt: skip
    intervals += list(_split_values(results, 0.1, "local.val_acc", "val_acc").values())  # the deployment one
    # issue 41's three splits, which the report keeps printing while issue 57's are added
    intervals += [v for beta in sp.SPLITS_BETAS for m, theirs in (("val_acc", None), ("local.val_acc", None),
                                                                   ("local.val_acc", "val_acc"))
                  for v in _split_values(results, beta, m, theirs, splits=sp.SPLIT_SEEDS).values()]  # fmt: skip
    return intervals, spreads


def _split_differences(results: dict, beta: float, metric: str, theirs: str | None = None,
                       splits=None) -> dict[int, list[float]]:  # fmt: skip
    """FedPA-LoRA's ``metric`` − FedIT's ``theirs`` per client split (``splits``, default all of the stage's at
    ``beta``), one difference per training seed both sides ran, recomputed here."""
    differences: dict[int, list[float]] = {}
    for split in splits or sp.split_seeds(beta):
        for seed in sp.split_training_seeds(split):
            runs = [results.get(sp.splits_key(m, beta, split, seed)) for m in ("fedpa", "fedit")]
            if all(runs):
                a, b = pr.final_metric(runs[0], metric), pr.final_metric(runs[1], theirs or metric)
                differences.setdefault(split, []).append(a - b)
    return differences


def _split_values(results: dict, beta: float, metric: str, theirs: str | None = None, splits=None) -> dict[str, tuple]:
    """The client-split stage's intervals: per split its paired t interval; across splits the t interval on the split
    means (scipy's one-sample t on them) and the fixed-split interval (within-split mean square, N − k df)."""
    from scipy import stats as scipy_stats

    full = {k: d for k, d in _split_differences(results, beta, metric, theirs, splits).items() if len(d) >= 2}
    out = {f"split {k}": stats.paired_interval(d) for k, d in full.items()}
    if len(full) >= 2:
        means = [statistics.fmean(d) for d in full.values()]
        ci = scipy_stats.ttest_1samp(means, 0.0).confidence_interval(0.95)
        out["across"] = (statistics.fmean(means), float(ci.low), float(ci.high))
        k, n = len(full), sum(len(d) for d in full.values())
        ms = sum((x - statistics.fmean(d)) ** 2 for d in full.values() for x in d) / (n - k)
        half = scipy_stats.t.ppf(0.975, n - k) * (ms * sum(1 / len(d) for d in full.values())) ** 0.5 / k
        out["fixed"] = (statistics.fmean(means), statistics.fmean(means) - half, statistics.fmean(means) + half)
    return out


def test_the_client_split_row_quotes_the_t_on_split_means_across_splits():
    """The verdict's client-split row quotes, per β and protocol, the t interval on the split means (the one that
    generalises to new splits) over the three splits it names (issue 41's), not the fixed-split or any bootstrap
    interval."""
    if not (ROOT / sp.REPORT / "runs" / "splits").is_dir():
        pytest.skip("no committed client-split runs")
    results = pr.load_results(ROOT / sp.REPORT)
    row = next(line for line in _protocol_section().splitlines() if line.startswith("| client splits"))
    for metric, column in zip(("val_acc", "local.val_acc"), row.split(" | ")[1:3]):
        quoted = [m for m in INTERVAL.finditer(column) if "across" in column[max(0, m.start() - 30) : m.start()]]
        assert len(quoted) == 2, column
        for beta, match in zip(sp.SPLITS_BETAS, quoted):
            want = _split_values(results, beta, metric, splits=sp.SPLIT_SEEDS)["across"]
            printed = [_plain(g) for g in match.groups()]
            assert [_points(v, p) for v, p in zip(want, printed)] == printed, (beta, metric, match.group(0))


def test_every_interval_and_spread_quoted_is_the_reports_rounded_once():
    if not (ROOT / sp.REPORT / "runs").is_dir():
        pytest.skip("no committed runs")
    intervals, spreads = _report_values()
    section = _protocol_section()
    stale = []
    for match in INTERVAL.finditer(section):
        printed = [_plain(g) for g in match.groups()]
        if not any([_points(v, p) for v, p in zip(values, printed)] == printed for values in intervals):
            stale.append(match.group(0))
    for match in MEAN_STD.finditer(section):
        mean, std = match.groups()
        if not any((f"{m:.{len(mean) - 2}f}", f"{s:.{len(std) - 2}f}") == (mean, std) for m, s in spreads):
            stale.append(match.group(0))
    assert stale == [], (
        f"README.md, docs/study/verdict.md or docs/study/sst2_protocol.md quote numbers not the report's rounded once: "
        f"{stale}"
    )


def test_the_checker_catches_a_double_rounding():
    # centralized LoRA's +3.647 points: +3.6 rounded once; +3.7 is 3.65 rounded again
    assert _points(0.03647, "3.7") == "3.6" and _points(-0.00004, "0.0") == "0.0"


def test_the_long_horizon_rows_quote_each_arms_own_interval():
    """Among thousands of intervals a stale number can match another pair's by chance (the interim row's −1.5 did);
    each long-horizon row of the verdict table must quote its own arm − FedIT interval, paper protocol then own
    factors, rounded once."""
    if not (ROOT / sp.REPORT / "runs" / "long").is_dir():
        pytest.skip("no committed long-horizon runs")
    results = pr.load_results(ROOT / sp.REPORT)
    letters = {"b": "fedpa", "c": "fedpa_adamw5e-3_lam1", "d": "fedpa_adamw5e-3_lam0.1"}
    assert [cell for cell, _, _ in sp.LONG_ARMS[1:]] == list(letters.values())
    rows = {m.group(1): m.group(0) for m in re.finditer(r"^\| long horizon, 60 rounds: \(([bcd])\).*$",
                                                        _protocol_section(), re.M)}  # fmt: skip
    assert sorted(rows) == ["b", "c", "d"]
    for letter, cell in letters.items():
        columns = rows[letter].split(" | ")[1:3]
        for metric, column in zip(("val_acc", "local.val_acc"), columns):
            ends = {}
            for key, run in results.items():
                if key.startswith("long/") and (v := sp.endpoint(run, metric)) is not None:
                    ends.setdefault(run["cell"], {})[run["seed"]] = v
            seeds = sorted(set(ends[cell]) & set(ends[sp.LONG_REFERENCE]))
            want = stats.paired_interval([ends[cell][s] - ends[sp.LONG_REFERENCE][s] for s in seeds])
            printed = [_plain(g) for g in INTERVAL.search(column).groups()]
            assert [_points(v, p) for v, p in zip(want, printed)] == printed, (letter, metric, column)


def test_the_one_model_per_client_numbers_quote_fedpas_own_adapter_against_fedits_global_adapter():
    """The deployment row and "Plainly" quote FedPA-LoRA's own adapter (local.val_acc) − FedIT's global adapter with
    the local head (val_acc), paired by seed: main cell (final round), 60 rounds (endpoint), partial participation."""
    if not (ROOT / sp.REPORT / "runs" / "partial").is_dir():
        pytest.skip("no committed partial-participation runs")
    results = pr.load_results(ROOT / sp.REPORT)

    def per_seed(stage, cell, metric, endpoint=False):
        return {r["seed"]: (sp.endpoint(r, metric) if endpoint else pr.final_metric(r, metric))
                for k, r in results.items() if k.startswith(f"{stage}/") and r["cell"] == cell}  # fmt: skip

    section = _protocol_section()
    row = next(line for line in section.splitlines() if line.startswith("| one model per client"))
    for text, stage, endpoint in (("main cell", "final", False), ("60 rounds", "long", True),
                                  ("partial participation", "partial", False)):  # fmt: skip
        own, glob = per_seed(stage, "fedpa", "local.val_acc", endpoint), per_seed(stage, "fedit", "val_acc", endpoint)
        seeds = sorted(set(own) & set(glob))
        want = stats.paired_interval([own[s] - glob[s] for s in seeds])
        match = INTERVAL.search(row[row.index(text) :])
        printed = [_plain(g) for g in match.groups()]
        assert [_points(v, p) for v, p in zip(want, printed)] == printed, (text, match.group(0))


PRIVACY_NAMES = {"FedPA-LoRA": "fedpa", "FedIT": "fedit", "FFA-LoRA": "ffa_lora", "FedSVD": "fedsvd"}


def _paired(a: dict[int, float], b: dict[int, float]) -> tuple[float, float, float]:
    """The paired t interval of a − b over the seeds both have (at least two)."""
    seeds = sorted(set(a) & set(b))
    assert len(seeds) >= 2
    return stats.paired_interval([a[s] - b[s] for s in seeds])


def test_the_privacy_row_quotes_each_methods_own_intervals():
    """The verdict's sample-level privacy row quotes, per protocol, "<method> − FedIT under DP" for the three other
    methods and "<method> under DP − without DP" for all four, each after the method's name, recomputed here from
    the run files (the DP cells are the privacy stage's; the no-DP runs the final stage's, FedSVD's the privacy
    stage's)."""
    if not (ROOT / sp.REPORT / "runs" / "privacy" / "fedit_dp_s0.json").is_file():
        pytest.skip("no committed sample-level privacy finals")
    results = pr.load_results(ROOT / sp.REPORT)
    row = next(line for line in _protocol_section().splitlines() if line.startswith("| privacy, sample level"))
    for metric, column in zip(("val_acc", "local.val_acc"), row.split(" | ")[1:3]):
        dp, final = pr.cell_values(results, metric, "privacy"), pr.cell_values(results, metric, "final")
        no_dp = {**{m: final[m] for m in ("fedpa", "fedit", "ffa_lora")}, "fedsvd": dp["fedsvd"]}

        against_fedit, without = column.split("without DP", 1) if "without DP" in column else (column, "")
        checked = 0
        for part, reference in ((against_fedit, "fedit_dp"), (without, None)):
            for name, method in PRIVACY_NAMES.items():
                match = re.search(re.escape(name) + r"[^\[|]*?" + INTERVAL.pattern, part)
                if match is None or (reference == "fedit_dp" and method == "fedit"):
                    continue
                want = _paired(dp[f"{method}_dp"], dp[reference] if reference else no_dp[method])
                printed = [_plain(g) for g in match.groups()]
                assert [_points(v, p) for v, p in zip(want, printed)] == printed, (metric, name, match.group(0))
                checked += 1
        assert checked >= 4, column
