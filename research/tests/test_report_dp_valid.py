"""The dpvalid report section: its paired intervals are scipy's t intervals over seeds, a Holm family is labelled
only when all its rows are in, and the gate line follows the search."""

from __future__ import annotations

import statistics

import pytest
from scipy import stats as scipy_stats

from research.study import report_dp_valid as rv
from research.study import sst2_dp_regime as dr
from research.study import sst2_dp_valid as dv


def _run(cell: str, seed: int, acc: float, stage: str = "dpvalid") -> tuple[str, dict]:
    return f"{stage}/{cell}_s{seed}", {"cell": cell, "seed": seed, "rounds": {119: {"val_acc": acc,
                                                                                 "local.val_acc": acc + 0.01}}}


def _finals(shift: dict[str, float]) -> dict:
    results = {}
    for seed in (0, 1, 2):
        for m in dr.METHODS:
            private = 0.80 + shift[m] + 0.01 * seed**2
            results.update([_run(m, seed, 0.80 + 0.003 * seed), _run(f"{m}_dp", seed, private)])
    return results


def test_the_dp_cost_rows_are_t_intervals_over_seeds_with_holm_once_complete():
    shift = {"fedpa": -0.30, "fedit": -0.03, "ffa_lora": -0.05, "fedsvd": -0.04}
    results = _finals(shift)
    rows = rv.comparisons(results, "val_acc")
    d = [(0.80 + shift["fedit"] + 0.01 * s**2) - (0.80 + 0.003 * s) for s in (0, 1, 2)]
    half = scipy_stats.t.ppf(0.975, 2) * statistics.stdev(d) / 3**0.5
    row = rows["fedit_dp − fedit"]
    assert row["mean"] == pytest.approx(statistics.fmean(d)) and row["low"] == pytest.approx(statistics.fmean(d) - half)
    assert all("holm" in rows[k] for k in ("fedpa_dp − fedpa", "fedpa_dp − fedit_dp"))
    del results["dpvalid/fedsvd_dp_s0"], results["dpvalid/fedsvd_dp_s1"]  # one family left incomplete
    rows = rv.comparisons(results, "val_acc")
    assert "fedsvd_dp − fedsvd" not in rows and "holm" not in rows["fedit_dp − fedit"]
    assert "Holm: the family is not complete" in "\n".join(rv.final_lines(results))


def test_the_gate_line_names_the_best_search_run():
    results = {r.key: {"cell": r.name, "seed": 0, "rounds": {89: {"val_acc": 0.7}, 119: {"val_acc": 0.7}}}
               for r in dv.search_1()}  # fmt: skip
    first, second, _ = dv.selected(results)
    for run in second:
        results[run.key] = {"cell": run.name, "seed": 0, "rounds": {89: {"val_acc": 0.9}, 119: {"val_acc": 0.8}}}
    text = "\n".join(rv.search_lines(results))
    assert f"{second[0].name} (0.8500), passes the declared gate" in text


def test_the_one_sentence_summary_quotes_scipys_intervals_and_names_the_best_dp_method():
    shift = {"fedpa": -0.30, "fedit": -0.03, "ffa_lora": -0.05, "fedsvd": -0.04}
    results = _finals(shift)
    text = "\n".join(rv.plainly_lines(results))
    d = [(0.80 + shift["fedit"] + 0.01 * s**2) - (0.80 + 0.003 * s) for s in (0, 1, 2)]
    half = scipy_stats.t.ppf(0.975, 2) * statistics.stdev(d) / 3**0.5
    mean = statistics.fmean(d)
    assert f"costs FedIT {100 * mean:+.1f} [{100 * (mean - half):+.1f}, {100 * (mean + half):+.1f}] points" in text
    assert "the best method here is fedit;" in text  # the highest mean under DP (FFA-LoRA and FedSVD lose more)
    # the cost is against FedIT without DP in the DP regime, named with its mean, not the main cell's FedIT
    no_dp = statistics.fmean(0.80 + 0.003 * s for s in (0, 1, 2))
    assert f"against FedIT without DP in the same regime ({no_dp:.4f}) (n=3" in text  # no main-cell runs here
    results.update([_run("fedit", s, 0.89, stage="final") for s in (0, 1)])
    text = "\n".join(rv.plainly_lines(results))
    assert f"in the same regime ({no_dp:.4f}; the main cell's FedIT, another regime, reaches 0.8900) (n=3" in text
    gap = 100 * (shift["fedpa"] - shift["fedit"])
    assert f"FedPA-LoRA against FedIT: {gap:+.1f} [" in text
    del results["dpvalid/fedsvd_dp_s0"], results["dpvalid/fedsvd_dp_s1"]  # a family not complete: no sentence yet
    assert rv.plainly_lines(results) == []


def test_the_refit_scores_are_labelled_outside_the_guarantee_wherever_shown():
    """The refitted heads read the training data without DP: their columns and the comparison that scores them say
    so."""
    runs = [r for r in dv.diagnostic_runs(dv.Valid("frozen", 0.01, 0.01), 0.01) if r.name.endswith("_refit")]
    head = rv.single_lines({}, runs, "Diagnostics", refit=True)[2]
    assert head.count("head refitted, outside the guarantee") == 2, head
    assert "outside the guarantee" not in rv.single_lines({}, runs, "Diagnostics")[2]
