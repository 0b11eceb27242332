"""The verdict across settings (research.study.sst2_verdict) against direct computations from the committed runs."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from research.study import protocol_results as pr
from research.study import sst2_protocol as sp
from research.study import sst2_verdict as sv

ROOT = Path(__file__).resolve().parents[2]
RUNS = ROOT / sp.REPORT / "runs"


def _last(path: Path, metric: str) -> float:
    rounds = json.loads(path.read_text())["rounds"]
    return [m[metric] for _, m in sorted(rounds.items(), key=lambda kv: int(kv[0])) if metric in m][-1]


def _t_interval(d: list[float]) -> tuple[float, float, float]:
    from scipy import stats

    n = len(d)
    mean = sum(d) / n
    sd = math.sqrt(sum((x - mean) ** 2 for x in d) / (n - 1))
    half = stats.t.ppf(0.975, n - 1) * sd / math.sqrt(n)
    return mean, mean - half, mean + half


@pytest.mark.skipif(not (RUNS / "final").is_dir(), reason="no committed final runs")
def test_the_deployment_table_pairs_fedpas_own_adapter_with_fedits_global_adapter_from_the_run_files():
    seeds = sorted(int(p.stem.rsplit("_s", 1)[1]) for p in (RUNS / "final").glob("fedpa_s*.json"))
    own = [_last(RUNS / "final" / f"fedpa_s{s}.json", "local.val_acc") for s in seeds]
    global_fedit = [_last(RUNS / "final" / f"fedit_s{s}.json", "val_acc") for s in seeds]
    want = _t_interval([a - b for a, b in zip(own, global_fedit)])
    rows = sv.deployment_rows(pr.load_results(ROOT / sp.REPORT))
    (row,) = [
        r for setting, label, r in rows if setting.startswith("main cell") and label.startswith("FedPA-LoRA own")
    ]
    assert (row["mean"], row["low"], row["high"]) == pytest.approx(want, abs=1e-12)
    assert row["seeds"] == len(seeds) == 5
    # one Holm family over the whole table: the smallest p is multiplied by the number of rows
    smallest = min(r["p"] for _, _, r in rows)
    assert all(r["holm"] == "ties" for _, _, r in rows) or len(rows) * smallest < 0.05
    assert len(rows) == len(sv.DEPLOYMENT) * len(sv.DEPLOYMENT_SETTINGS)


def test_the_split_analysis_pairs_by_split_and_seed_and_takes_the_committed_split_from_final_and_beta():
    """Synthetic results with a split effect: FedPA-LoRA − FedIT is +2 points on split 1, −2 on split 2, and 0 on
    the committed split; seeds 3-4 of the committed split are left out."""

    def run(stage, cell, seed, acc):
        return {"cell": cell, "seed": seed, "rounds": {20: {"val_acc": acc, "local.val_acc": acc}}}

    results = {}
    shift = {12345: 0.0, 1: 0.02, 2: -0.02}
    for split, d in shift.items():
        for seed in range(5 if split == 12345 else 3):
            noise = 0.001 * seed
            for method, acc in (("fedpa", 0.85 + d + noise), ("fedit", 0.85)):
                key = sp.splits_key(method, 0.5, split, seed)
                results[key] = run(key.split("/")[0], sp.splits_cell(method, 0.5, split), seed, acc)
    found = sv.split_analysis(results, 0.5, "val_acc")
    assert set(found["splits"]) == {12345, 1, 2}
    assert found["splits"][12345]["n"] == 3 and found["splits"][1]["ahead"] == 3 and found["splits"][2]["behind"] == 3
    assert found["splits"][1]["verdict"] == "wins" and found["splits"][2]["verdict"] == "loses"
    from scipy import stats

    means = [0.001, 0.021, -0.019]  # each split's mean difference: its shift + the mean seed noise 0.001
    ci = stats.ttest_1samp(means, 0.0).confidence_interval(0.95)
    across = found["across"]
    assert (across["mean"], across["low"], across["high"]) == pytest.approx((0.001, ci.low, ci.high), rel=1e-9)
    assert across["p"] == pytest.approx(stats.ttest_1samp(means, 0.0).pvalue) and across["df"] == 2
    fixed = found["fixed"]  # within-split variance only: the seeds' 0.001 steps, so far narrower
    assert fixed["df"] == 6 and fixed["high"] - fixed["low"] < (across["high"] - across["low"]) / 10
    v = found["variance"]
    assert (v["df_between"], v["df_within"]) == (2, 6) and v["var_split"] == pytest.approx(0.0004 - 1e-6 / 3, rel=0.01)


def _splits_results(shifts: dict[int, float], beta: float = 0.1) -> dict:
    """Synthetic split-stage results: FedPA-LoRA − FedIT = ``shifts[split]`` plus seed noise −0.001, 0, +0.001 on
    each split, under both protocols (the run's two metrics equal)."""
    results = {}
    for split, shift in shifts.items():
        for seed in sp.split_training_seeds(split):
            for method, acc in (("fedpa", 0.85 + shift + 0.001 * (seed - 1)), ("fedit", 0.85)):
                key = sp.splits_key(method, beta, split, seed)
                results[key] = {"cell": sp.splits_cell(method, beta, split), "seed": seed,
                                "rounds": {20: {"val_acc": acc, "local.val_acc": acc}}}  # fmt: skip
    return results


def test_the_verdict_figure_draws_a_raw_win_that_fails_holm_hollow(tmp_path, monkeypatch):
    """β = 0.1 across three splits with split means +1.5, +3.0, +2.0 points: the t on the split means gives p 0.039,
    a raw win; Holm over the splits section's three comparisons with runs (paper protocol, own factors, deployment,
    all alike) gives 0.117, a tie. The figure's row is green (raw) with a hollow dot (Holm): before issue 57 the
    across-split row took its raw label as its Holm label and was drawn filled."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from research.study import plots

    rows = sv.verdict_rows(_splits_results({12345: 0.015, 1: 0.03, 2: 0.02}))
    (row,) = [r for r in rows if r["setting"].startswith("β = 0.1 across client splits")]
    assert row["setting"] == "β = 0.1 across client splits (t on 3 split means)"
    paper = row["val_acc"]
    assert paper["verdict"] == "wins" and paper["holm"] == "ties"
    from scipy import stats

    assert stats.ttest_1samp([0.015, 0.03, 0.02], 0.0).pvalue == pytest.approx(0.0389, abs=1e-3)
    monkeypatch.setattr(plt, "close", lambda *a: None)
    plots.plot_verdict(rows, tmp_path / "verdict.png")
    ax = plt.gcf().axes[0]
    (dot,) = [line for line in ax.lines if line.get_marker() == "o" and line.get_xdata()[0] == 100 * paper["mean"]]
    assert dot.get_markerfacecolor() in ("white", (1.0, 1.0, 1.0, 1.0))
    assert dot.get_color() == plots.VERDICT_COLOURS["wins"]
    plt.close("all")


def test_a_row_that_survives_holm_is_filled(tmp_path, monkeypatch):
    """The same figure with three clearly separated splits (p well under 0.05 / 3): raw and Holm both win, filled."""
    pytest.importorskip("matplotlib")
    import matplotlib.pyplot as plt

    from research.study import plots

    rows = sv.verdict_rows(_splits_results({12345: 0.020, 1: 0.021, 2: 0.022}))
    (row,) = [r for r in rows if r["setting"].startswith("β = 0.1 across client splits")]
    assert row["val_acc"]["holm"] == "wins"
    monkeypatch.setattr(plt, "close", lambda *a: None)
    plots.plot_verdict(rows, tmp_path / "verdict.png")
    ax = plt.gcf().axes[0]
    (dot,) = [line for line in ax.lines if line.get_marker() == "o" and line.get_xdata()[0] == 100 * row["val_acc"]["mean"]]
    assert dot.get_markerfacecolor() == dot.get_color()
    plt.close("all")


def test_the_across_split_family_takes_eight_splits_at_beta_01_and_holm_over_its_comparisons():
    """Splits 3-7 at β = 0.1 enter with their two seeds; the t has 7 df; the family is every comparison with runs."""
    from scipy import stats

    shifts = {12345: 0.01, 1: 0.02, 2: 0.0, 3: 0.01, 4: -0.01, 5: 0.02, 6: 0.015, 7: 0.005}
    family = sv.across_split_rows(_splits_results(shifts))
    assert set(family) == {label for label, beta, *_ in sv.ACROSS_SPLITS if beta == 0.1}
    row = family["β = 0.1, paper protocol"]
    means = [shift + (0.0 if split in sp.SPLIT_SEEDS else -0.0005) for split, shift in shifts.items()]
    assert row["splits"] == 8 and row["df"] == 7
    assert row["p"] == pytest.approx(stats.ttest_1samp(means, 0.0).pvalue, rel=1e-9)
    assert row["holm_p"] == pytest.approx(min(1.0, 3 * row["p"]), rel=1e-9)  # three equal p-values


def _holm_by_hand(p: dict) -> dict:
    """Holm's step-down at 0.05, written out: the i-th smallest p is compared with 0.05 / (m - i); stop at the
    first that fails."""
    order, out, m = sorted(p, key=p.get), {k: False for k in p}, len(p)
    for i, key in enumerate(order):
        if p[key] >= 0.05 / (m - i):
            break
        out[key] = True
    return out


@pytest.mark.skipif(not (RUNS / "partial").is_dir(), reason="no committed partial-participation runs")
def test_holm_takes_one_family_per_table_and_protocol_in_the_partial_and_beta_tables():
    from scipy import stats

    results = pr.load_results(ROOT / sp.REPORT)
    for metric in sv.METRICS:
        rows = sv.partial_intervals(results)[metric]
        assert len(rows) == 4  # 2 FedPA-LoRA arms x 2 baselines: one family
        p = {}
        for arm, other in rows:
            a = {s: _last(RUNS / "partial" / f"{arm}_s{s}.json", metric) for s in (0, 1, 2)}
            b = {s: _last(RUNS / "partial" / f"{other}_s{s}.json", metric) for s in (0, 1, 2)}
            p[(arm, other)] = stats.ttest_rel(list(a.values()), list(b.values())).pvalue
        survives = _holm_by_hand(p)
        assert {k: r["holm"] != "ties" for k, r in rows.items()} == survives
    # the case the two-per-arm families got wrong: lambda = 1 - FedIT with own factors is a raw loss, a Holm tie
    row = sv.partial_intervals(results)["local.val_acc"][("fedpa_adamw5e-3_lam1", "fedit")]
    assert row["verdict"] == "loses" and row["holm"] == "ties"
    # the beta table: beta = 0.1 and beta = 100 together, one family of every row under one protocol
    beta = {
        r["cell"]: f"fedpa_beta{r['cell'].rsplit('_beta', 1)[1]}" for k, r in results.items() if k.startswith("beta/")
    }
    rows = sv.family_rows(results, pr.cell_values(results, "val_acc", "beta"), beta, "val_acc")
    assert len(rows) == 6
    assert {c: r["holm"] != "ties" for c, r in rows.items()} == _holm_by_hand({c: r["p"] for c, r in rows.items()})
