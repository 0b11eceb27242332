"""The report's dpregime section on fabricated run files: the search table, the selection, the finals' paired
intervals (checked against a t interval computed here) with Holm once a family is complete, ε in the other
convention, and the figure."""

from __future__ import annotations

import statistics

import pytest

from research.study import sst2_dp_regime as dr
from research.study import sst2_protocol as sp
from research.study import report_dp_regime as rr

SELECTED = {"methods": {m: {"method": m, "optimizer": "AdamW", "lr": 5e-3, "lam": 0.01 if m == "fedpa" else None}
                        for m in ("fedpa", "fedit", "ffa_lora")}}  # fmt: skip
LEDGER = {"1": {"epsilon": 7.99, "delta": 1e-5, "noise_multiplier": 0.84, "steps": 120, "n": 3544, "b": 256},
          "3": {"epsilon": 0.0, "delta": 1e-5, "noise_multiplier": 0.0, "steps": 0, "n": 634, "b": 256}}  # fmt: skip


def _result(run: sp.Run, acc: float, sampling: str = "poisson") -> dict:
    every = run.rounds // dr.EVALS
    o = dict(zip(run.opts[::2], run.opts[1::2]))
    privacy = {"dp_epsilon": 7.99, "dp_sampling": sampling, "dp_clients": LEDGER} if "fedpa.dp_mode" in o else None
    return {
        "cell": run.name, "seed": run.seed, "opts": list(run.opts), "fs_opts": [], "seconds": 60.0,
        "rounds_planned": run.rounds, "privacy": privacy,
        "rounds": {r: {"val_acc": acc, "val_f1": 0.5} for r in range(every - 1, run.rounds, every)},
        "diagnostics": [{"global_update_norm": 0.5, "delta_norm_mean": 1.0, "global_norm": 2.0}],
    }  # fmt: skip


def _complete_search(results: dict) -> None:
    """Every search part's runs, as each part appears once the earlier ones are in: A's best wins."""
    for run in dr.search_a():
        results[run.key] = _result(run, 0.80 if run.name.startswith("search_b1024_tau2_local") else 0.75)
    while missing := [r for part, runs in dr.runs(SELECTED, results) if "search" in part for r in runs
                      if r.key not in results]:  # fmt: skip
        for run in missing:
            results[run.key] = _result(run, 0.75)


def test_the_section_shows_the_search_then_the_selected_regime_and_the_finals_with_holm(tmp_path):
    results: dict = {}
    _complete_search(results)
    regime = dr.selected_regime(results)
    assert regime == dr.Regime(1024, 2, "local", (4, 5), "AdamW", 5e-4)
    finals = dict(dr.runs(SELECTED, results))["dp regime: finals"]
    fedpa = {0: 0.80, 1: 0.83, 2: 0.81}
    for run in finals:
        acc = fedpa[run.seed] if run.name == "fedpa_dp" else 0.78 + 0.01 * run.seed
        results[run.key] = _result(run, acc, "wor" if run.name.endswith("replace") else "poisson")
    text = "\n".join(rr.dp_regime_section(results, dr.runs(SELECTED, results), tmp_path))
    assert "| b1024_tau2_local_l45_adamw0.0005 | 1024 | 2 | local | [4, 5] | AdamW 0.0005 | 1 | 0.8000 |" in text
    assert "| b256_tau2_local_l45_adamw0.0005_c0.01 | 256 | 2 | local | [4, 5] | AdamW 0.0005 | 0.01 |" in text
    assert "b1024_tau2_local_l45_adamw0.0005_c0.01 |" not in text  # amendment G dropped C's b = 1,024 runs
    assert f"Selected regime (best held-out score, the first of ties): `{regime.name}`." in text
    # the paired interval of fedpa_dp - fedit_dp, computed here: differences 0.02, 0.04, 0.01
    d = [0.02, 0.04, 0.01]
    half = 4.302653 * statistics.stdev(d) / 3**0.5
    mean = statistics.fmean(d)
    row = next(line for line in text.splitlines() if line.startswith("| fedpa_dp − fedit_dp |"))
    assert f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]; n=3, ahead in 3; Holm p" in row
    assert (tmp_path / dr.STAGE / "dp_regime.png").stat().st_size > 10_000


def test_the_finals_wait_for_the_search_and_say_so(tmp_path):
    results: dict = {}
    text = "\n".join(rr.dp_regime_section(results, dr.runs(SELECTED, results), tmp_path))
    assert "not run yet" in text and "selected once the search's runs are in" in text


def test_the_other_reading_of_a_poisson_ledger_keeps_its_sampling_and_of_a_fixed_size_one_is_the_poisson_target():
    pytest.importorskip("dp_accounting", reason="dp-accounting is not installed (the dp extra)")
    from fs_fedpa.privacy.accountant import Sampled

    # a run's ledger: z = 0.84 calibrated by PLD to epsilon 7.99 with Poisson sampling (a real run's client)
    (poisson,) = rr.other_reading({"privacy": {"dp_sampling": "poisson", "dp_clients": LEDGER}})
    (fixed,) = rr.other_reading({"privacy": {"dp_sampling": "wor", "dp_clients": LEDGER}})
    # the run sampled by Poisson: read as replace-one it keeps that sampling (the +C/-C pair), a little above the
    # ledger, not the fixed-size reading of the same noise, which states several times more
    fixed_size = Sampled(3544, 256, 0.84, "wor", "pld").epsilon(120, 1e-5)
    assert 7.99 < poisson < 1.5 * 7.99 < fixed_size
    # the fixed-size ledger read with Poisson and add/remove is the Poisson calibration again, by RDP (>= the PLD's)
    assert 7.99 <= fixed <= 1.3 * 7.99


def test_the_diagnostics_sit_beside_the_search_run_of_their_regime(tmp_path):
    results: dict = {}
    _complete_search(results)
    d = dict(dr.runs(SELECTED, results))["dp regime: diagnostics D (not selecting)"]
    assert [r.name for r in d] == ["diag_b1024_tau2_local_l45_adamw0.0005_nodp",
                                   "diag_b1024_tau2_local_l45_adamw0.0005_z0.01"]  # fmt: skip
    for run, acc in zip(d, (0.86, 0.84)):
        results[run.key] = _result(run, acc)
        results[run.key]["rounds"][run.rounds - 1]["val_avg_loss"] = 0.3
    text = "\n".join(rr.dp_regime_section(results, dr.runs(SELECTED, results), tmp_path))
    # the regime's own ε = 8 run: search A's best at C = 1 scored 0.80
    assert "| diag_b1024_tau2_local_l45_adamw0.0005_nodp | no | – | – | 0.8600 | 0.5000 | 0.3000 | 0.8000 |" in text
    row = "| diag_b1024_tau2_local_l45_adamw0.0005_z0.01 | yes | 1 | 0.01 | 0.8400 | 0.5000 | 0.3000 | 0.8000 |"
    assert row in text
    assert "diagnostics F" not in text and "Amendment G" in text  # G dropped F's run without DP


def test_amendment_i_pairs_the_other_three_under_dp_in_a_family_of_its_own(tmp_path):
    results: dict = {}
    _complete_search(results)
    ffa = {0: 0.75, 1: 0.79, 2: 0.76}
    for run in dict(dr.runs(SELECTED, results))["dp regime: finals"]:
        acc = ffa[run.seed] if run.name == "ffa_lora_dp" else 0.78 + 0.01 * run.seed
        results[run.key] = _result(run, acc)
    text = "\n".join(rr.final_lines(results))
    assert "the other three pairwise under DP, Holm over 3 (amendment I" in text
    # fedit_dp − ffa_lora_dp, by hand: differences 0.03, 0.00, 0.04
    d = [0.03, 0.00, 0.04]
    half = 4.302653 * statistics.stdev(d) / 3**0.5
    mean = statistics.fmean(d)
    row = next(line for line in text.splitlines() if line.startswith("| fedit_dp − ffa_lora_dp |"))
    assert f"{mean:+.4f} [{mean - half:+.4f}, {mean + half:+.4f}]; n=3, ahead in 2; Holm p" in row
    assert next(line for line in text.splitlines() if line.startswith("| ffa_lora_dp − fedsvd_dp |"))
    assert "| fedit_dp − fedit |" in text and "| fedsvd_dp − fedit_dp |" not in text
