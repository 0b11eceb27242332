"""The privacy section of the SST-2 report on synthetic run files: what is pending, the selection, and the paired
intervals and Holm adjustment, against scipy."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
from scipy import stats

from research.study import sst2_privacy as spriv
from research.study import sst2_protocol as sp
from research.study.report_privacy import final_comparisons, privacy_section

SELECTED = json.loads((Path(__file__).resolve().parents[2] / sp.REPORT / "selected.json").read_text())


def _run(cell: str, seed: int, acc: float, own: float, eps: float | None = None) -> dict:
    run = {"cell": cell, "seed": seed, "rounds": {20: {"val_acc": acc, "local.val_acc": own}}}
    if eps is not None:
        run["privacy"] = {"dp_epsilon": eps, "dp_clip": 0.5, "dp_noise_std": 0.01}
    return run


def _stages(results: dict) -> list:
    tune = spriv.privacy_tune_runs(SELECTED, SELECTED["T"])
    plain, private = spriv.client_dp_runs(SELECTED, results)
    parts = [("privacy: sample-level tuning", tune)]
    if choice := spriv.privacy_selection(results, tune):
        parts.append(("privacy: sample-level final", spriv.privacy_final_runs(choice, SELECTED["T"])))
    return [*parts, ("privacy: client level, no DP", plain), ("privacy: client level, DP", private)]


def test_nothing_run_yet_lists_every_tuning_run_as_pending():
    text = "\n".join(privacy_section({}, _stages({})))
    tune = spriv.privacy_tune_runs(SELECTED, SELECTED["T"])
    assert f"0 of its {len(tune)} runs are in" in text
    assert text.count("not run yet") == len(tune)
    assert "follow when all of its tuning runs are in" in text
    assert "(b) Client-level DP" in text  # independent of the tuning


@pytest.fixture
def full_results() -> dict:
    rng = random.Random(0)
    results = {}
    for run in spriv.privacy_tune_runs(SELECTED, SELECTED["T"]):
        results[run.key] = {"cell": run.name, "seed": 0, "rounds": {10: {"val_acc": rng.uniform(0.6, 0.9)}}}
    for seed in sp.SEEDS:
        for cell in ("fedpa_dp", "fedit_dp", "ffa_lora_dp", "fedsvd_dp", "fedsvd"):
            acc = rng.uniform(0.7, 0.9)
            results[f"privacy/{cell}_s{seed}"] = _run(cell, seed, acc, acc - 0.01, 7.9 if "dp" in cell else None)
        for cell in ("fedpa", "fedit", "ffa_lora"):
            results[f"final/{cell}_s{seed}"] = _run(cell, seed, rng.uniform(0.8, 0.9), rng.uniform(0.8, 0.9))
    return results


def test_the_intervals_and_holm_are_scipys(full_results):
    rows = final_comparisons(full_results)["val_acc"]
    pvalues = {}
    for cell in ("fedpa_dp", "ffa_lora_dp", "fedsvd_dp"):
        a = [full_results[f"privacy/{cell}_s{s}"]["rounds"][20]["val_acc"] for s in sp.SEEDS]
        b = [full_results[f"privacy/fedit_dp_s{s}"]["rounds"][20]["val_acc"] for s in sp.SEEDS]
        d = [x - y for x, y in zip(a, b)]
        low, high = stats.t.interval(0.95, len(d) - 1, loc=sum(d) / 3, scale=stats.sem(d))
        row = rows[f"{cell} − fedit_dp"]
        assert (row["low"], row["high"]) == pytest.approx((low, high))
        pvalues[cell] = stats.ttest_rel(a, b).pvalue
        assert row["p"] == pytest.approx(pvalues[cell])
    order = sorted(pvalues, key=pvalues.get)  # Holm by hand: 3p, 2p, p, made monotone
    adjusted = [min(1, (3 - i) * pvalues[c]) for i, c in enumerate(order)]
    adjusted = [max(adjusted[: i + 1]) for i in range(3)]
    assert [rows[f"{c} − fedit_dp"]["holm_p"] for c in order] == pytest.approx(adjusted)
    d = [full_results[f"privacy/fedpa_dp_s{s}"]["rounds"][20]["val_acc"]
         - full_results[f"final/fedpa_s{s}"]["rounds"][20]["val_acc"] for s in sp.SEEDS]  # fmt: skip
    assert rows["fedpa_dp − no DP"]["mean"] == pytest.approx(sum(d) / 3)
    plain = {}  # the second family: each DP cell against itself without DP, Holm over the four by hand
    for cell, (stage, base) in {
        "fedpa_dp": ("final", "fedpa"),
        "fedit_dp": ("final", "fedit"),
        "ffa_lora_dp": ("final", "ffa_lora"),
        "fedsvd_dp": ("privacy", "fedsvd"),
    }.items():
        a = [full_results[f"privacy/{cell}_s{s}"]["rounds"][20]["val_acc"] for s in sp.SEEDS]
        b = [full_results[f"{stage}/{base}_s{s}"]["rounds"][20]["val_acc"] for s in sp.SEEDS]
        plain[cell] = stats.ttest_rel(a, b).pvalue
    order = sorted(plain, key=plain.get)
    adjusted = [min(1, (4 - i) * plain[c]) for i, c in enumerate(order)]
    adjusted = [max(adjusted[: i + 1]) for i in range(4)]
    assert [rows[f"{c} − no DP"]["holm_p"] for c in order] == pytest.approx(adjusted)


def test_the_selection_and_the_final_table_appear_once_tuning_is_in(full_results):
    text = "\n".join(privacy_section(full_results, _stages(full_results)))
    tune = spriv.privacy_tune_runs(SELECTED, SELECTED["T"])
    best = max((r for r in tune if r.method == "fedit"), key=lambda r: full_results[r.key]["rounds"][10]["val_acc"])
    chosen = dict(zip(best.opts[::2], best.opts[1::2]))
    assert f"fedit_dp: AdamW {chosen['train.optimizer.lr']}, C {chosen['fedpa.dp_clip']}" in text
    assert "| fedpa_dp − fedit_dp | " in text and "Holm p" in text
    assert "| fedsvd_dp | " in text and "7.90 |" in text


def _diagnostics(updates_by_round):
    """A run's diagnostics for client updates given as arrays: the norm of their mean and the mean of their norms,
    what the server records (equal weights)."""
    import numpy as np

    return [{"round": r, "global_update_norm": float(np.linalg.norm(np.mean(u, 0))),
             "delta_norm_mean": float(np.mean(np.linalg.norm(u, axis=1)))}
            for r, u in enumerate(updates_by_round)]  # fmt: skip


def test_agreement_reads_orthogonal_and_shared_updates():
    import numpy as np

    from research.study.report_privacy import agreement

    rng = np.random.default_rng(0)
    shared = rng.normal(size=20000)
    noise = [rng.normal(size=(10, 20000)) for _ in range(3)]  # nearly orthogonal in 20,000 dimensions
    alike = [np.stack([shared * (1 + 0.01 * i) for i in range(10)]) for _ in range(3)]
    assert agreement({"diagnostics": _diagnostics(noise)}) == pytest.approx(10**-0.5, abs=0.01)
    assert agreement({"diagnostics": _diagnostics(alike)}) == pytest.approx(1.0, abs=1e-3)
    rounds = _diagnostics([noise[0], alike[0], alike[1], noise[1]])  # an even count: the middle two's mean
    assert agreement({"diagnostics": rounds}) == pytest.approx((10**-0.5 + 1) / 2, abs=0.01)
    assert agreement({"diagnostics": [{"round": 0, "global_update_norm": 1.0, "delta_norm_mean": 0.0}]}) is None


def test_the_tuning_table_shows_macro_f1_and_fedpa_agreement_beside_its_no_dp_run():
    import numpy as np

    rng = np.random.default_rng(1)
    tune = spriv.privacy_tune_runs(SELECTED, SELECTED["T"])
    fedpa = next(r for r in tune if r.method == "fedpa")
    opts = dict(zip(fedpa.opts[::2], fedpa.opts[1::2]))
    rounds = {2: {"val_acc": 0.75, "val_f1": 0.40}, 5: {"val_acc": 0.75, "val_f1": 0.42},
              8: {"val_acc": 0.75, "val_f1": 0.44}}  # fmt: skip
    results = {fedpa.key: {"cell": fedpa.name, "seed": 0, "rounds": rounds,
                           "diagnostics": _diagnostics([rng.normal(size=(10, 5000)) for _ in range(3)])}}  # fmt: skip
    plain = f"tune/fedpa_{opts['train.optimizer.type'].lower()}{opts['train.optimizer.lr']}_lam{opts['fedpa.lam']}_s0"
    results[plain] = {"diagnostics": [{"round": 0, "global_update_norm": 0.6, "delta_norm_mean": 1.0}]}
    text = "\n".join(privacy_section(results, _stages(results)))
    row = next(line for line in text.splitlines() if line.startswith("| fedpa |") and "0.7500" in line)
    assert "| 0.4300 |" in row  # the last two evaluations' macro-F1, 0.42 and 0.44
    assert "(no DP: 0.600)" in text and "What DP-SGD leaves of FedPA-LoRA's shared direction" in text
