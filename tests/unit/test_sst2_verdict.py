"""The verdict across settings (fs_fedpa.sst2_verdict) against direct computations from the committed run files."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from fs_fedpa import sst2_protocol as sp
from fs_fedpa import sst2_verdict as sv

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
    rows = sv.deployment_rows(sp.load_results(ROOT / sp.REPORT))
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
    found = sv.split_analysis(results, 0.5, "val_acc", draws=2000)
    assert set(found["splits"]) == {12345, 1, 2}
    assert found["splits"][12345]["n"] == 3 and found["splits"][1]["ahead"] == 3 and found["splits"][2]["behind"] == 3
    assert found["splits"][1]["verdict"] == "wins" and found["splits"][2]["verdict"] == "loses"
    assert found["nested"][0] == pytest.approx(0.001)  # the mean of the split means
    assert found["nested"][1] < -0.01 and found["nested"][2] > 0.01  # the split effect widens it
    v = found["variance"]
    assert (v["df_between"], v["df_within"]) == (2, 6) and v["var_split"] == pytest.approx(0.0004 - 1e-6 / 3, rel=0.01)
    from scipy import stats

    pooled = [d + 0.001 * seed for d in shift.values() for seed in range(3)]  # the 9 paired differences
    assert found["pooled_p"] == pytest.approx(stats.ttest_1samp(pooled, 0.0).pvalue, rel=1e-6)


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

    results = sp.load_results(ROOT / sp.REPORT)
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
    rows = sv.family_rows(results, sp.cell_values(results, "val_acc", "beta"), beta, "val_acc")
    assert len(rows) == 6
    assert {c: r["holm"] != "ties" for c, r in rows.items()} == _holm_by_hand({c: r["p"] for c, r in rows.items()})
