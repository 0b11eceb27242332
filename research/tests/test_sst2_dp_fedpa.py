"""The dpfedpa stage as declared: step 1 changes only the clip and the noise of dpvalid's FedPA-LoRA DP final, each
variant only its own keys, the finals run only past the gate; and its report section: the locked-client count, the
gate line, the finals' t intervals with Holm over two, the one-sentence findings."""

from __future__ import annotations

import statistics

import pytest
from scipy import stats as scipy_stats

from research.study import report_dp_fedpa as rf
from research.study import sst2_dp_fedpa as df
from research.study import sst2_dp_valid as dv
from research.study import sst2_protocol as sp

LAM = 0.01
SELECTED = {"methods": {"fedpa": {"lam": LAM}}}


def _opts(run: sp.Run) -> dict[str, str]:
    return dict(zip(run.opts[::2], run.opts[1::2]))


def _committed_final() -> dict[str, str]:
    final = next(r for r in dv.final_runs(df.POINT, LAM) if r.name == "fedpa_dp" and r.seed == 0)
    return _opts(final)


def test_step_1_changes_only_the_clip_and_the_noise_of_the_committed_dp_final():
    dp = _committed_final()
    mechanism = {"fedpa.dp_epsilon", "fedpa.dp_horizon", "fedpa.dp_clip", "fedpa.dp_noise_multiplier",
                 "fedpa.dp_accountant"}  # fmt: skip
    expected = {"sep_clip": ("0.01", 1e-9), "sep_noise": ("1e+06", df.MEDIAN_Z * 0.01 / 1e6),
                "sep_neither": ("1e+06", 1e-9)}  # fmt: skip
    for run in df.step_1(LAM):
        opts = _opts(run)
        if run.name == "base_refit":
            assert opts["train.optimizer.lr"] == "0" and opts["fedpa.eval_refit_head"] == "True" and run.rounds == 1
            assert not any(k.startswith("fedpa.dp") for k in opts)
            continue
        assert {k: v for k, v in opts.items() if k not in mechanism} == {k: v for k, v in dp.items()
                                                                        if k not in mechanism}  # fmt: skip
        clip, z = expected[run.name]
        assert opts["fedpa.dp_clip"] == clip and float(opts["fedpa.dp_noise_multiplier"]) == pytest.approx(z)
        # the same absolute noise per entry as a client at the median z under C = 0.01
        assert run.name != "sep_noise" or float(clip) * z == pytest.approx(df.MEDIAN_Z * 0.01)
        assert run.seed == 0 and run.rounds == dv.REGIME.rounds


def test_each_variant_adds_only_its_own_keys_to_the_dp_final_on_the_held_out_split():
    dp = {k: v for k, v in _committed_final().items() if k not in dict(zip(sp.FINAL_EVAL[::2], sp.FINAL_EVAL[1::2]))}
    own = {"var_grouped": {"fedpa.dp.local_tensors": "grouped", "fedpa.dp.local_clip": "0.01"},
           "var_prior": {"fedpa.dp.label_prior": f"{df.PRIOR_SIGMA:g}"},
           "var_restart_mu0.2": {"fedpa.fedpa_partial_restart.mu": "0.2"},
           "var_restart_mu0.5": {"fedpa.fedpa_partial_restart.mu": "0.5"},
           "var_moments": {"fedpa.keep_moments": "True"}}  # fmt: skip
    runs = df.variants(LAM)
    assert [r.name for r in runs] == list(own)
    for run in runs:
        opts = _opts(run)
        base = {k: v for k, v in dp.items() if not (run.name == "var_grouped" and k == "fedpa.dp_local_tensors")}
        assert opts == {**base, **own[run.name], **dict(zip(sp.TUNE_EVAL[::2], sp.TUNE_EVAL[1::2]))}
        assert run.method == ("fedpa_partial_restart" if "restart" in run.name else "fedpa") and run.seed == 0


def _result(accs: list[float], **extra) -> dict:
    return {"rounds": {29 + 30 * i: {"val_acc": a, "local.val_acc": a + 0.01} for i, a in enumerate(accs)}, **extra}


def _variants(scores: dict[str, float]) -> dict:
    return {r.key: _result([0.5, scores[r.name], scores[r.name]], cell=r.name, seed=0) for r in df.variants(LAM)}


def test_the_finals_run_once_every_variant_is_in_gate_or_not():
    """The amendment: the best variant's finals run whether or not it passes the gate."""
    finals = "dp fedpa: finals of the selected variant (seeds 0-2, dev)"
    scores = {r.name: 0.70 for r in df.variants(LAM)}
    scores["var_prior"] = 0.72
    results = _variants(scores)
    assert not df.passes_gate(results, LAM)
    parts = dict(df.runs(SELECTED, results))
    assert [(r.name, r.seed) for r in parts[finals]] == [("prior_dp", 0), ("prior_dp", 1), ("prior_dp", 2)]
    opts = _opts(parts[finals][0])
    assert opts["data.glue_holdout"] == "0" and opts["fedpa.eval_local"] == "True"
    assert opts["fedpa.dp.label_prior"] == "20" and parts[finals][0].method == "fedpa"
    scores["var_moments"] = 0.80
    results = _variants(scores)
    assert df.passes_gate(results, LAM) and dict(df.runs(SELECTED, results))[finals][0].name == "moments_dp"
    del results[df.variants(LAM)[0].key]
    assert df.selected(results, LAM) is None and finals not in dict(df.runs(SELECTED, results))


def test_the_stage_is_priced_near_the_issues_eight_cpu_hours():
    assert 5 < df.stage_hours() < 11


def _clients(own: dict[str, float], steps: dict[str, int] | None = None) -> dict:
    return {"clients": {c: {"val_acc": 1 - v, "local.val_acc": v} for c, v in own.items()},
            "privacy": {"dp_clients": {c: {"steps": (steps or {}).get(c, 120)} for c in own}}}  # fmt: skip


def test_a_client_is_locked_when_its_own_model_scores_its_shards_majority_share():
    committed = {"dpvalid/fedpa_dp_s0": {**_result([0.5]), **_clients({"1": 0.9, "2": 0.7, "3": 0.6},
                                                                       {"3": 0})}}  # fmt: skip
    shares = rf.majority_shares(committed)
    assert shares == pytest.approx({"1": 0.9, "2": 0.7})  # client 3 took no step
    run = {**_result([0.6]), "clients": {"1": {"local.val_acc": 0.9}, "2": {"local.val_acc": 0.75}}}
    assert rf.prior_locked(run, shares) == (1, 2)
    assert rf.prior_locked(None, shares) is None


def test_the_finals_are_t_intervals_over_seeds_with_holm_over_two():
    results = _variants({r.name: (0.8 if r.name == "var_moments" else 0.7) for r in df.variants(LAM)})
    mine, fedit, nodp = [0.80, 0.78, 0.83], [0.79, 0.80, 0.80], [0.84, 0.83, 0.85]
    for s in range(3):
        results[f"dpfedpa/moments_dp_s{s}"] = {**_result([mine[s]]), "cell": "moments_dp", "seed": s}
        results[f"dpvalid/fedit_dp_s{s}"] = {**_result([fedit[s]]), "cell": "fedit_dp", "seed": s}
        results[f"dpvalid/fedpa_s{s}"] = {**_result([nodp[s]]), "cell": "fedpa", "seed": s}
    cell, rows = rf.final_rows(results, LAM)
    assert cell == "moments_dp"
    d = [a - b for a, b in zip(mine, fedit)]
    half = scipy_stats.t.ppf(0.975, 2) * statistics.stdev(d) / 3**0.5
    row = rows["moments_dp − fedit_dp"]
    assert row["mean"] == pytest.approx(statistics.fmean(d))
    assert row["low"] == pytest.approx(statistics.fmean(d) - half)
    p = [rows[k]["p"] for k in ("moments_dp − fedit_dp", "moments_dp − fedpa_nodp")]
    assert sorted(rows[k]["holm_p"] for k in rows) == pytest.approx(sorted([min(1, 2 * min(p)), max(p)]))
    text = "\n".join(rf.dp_fedpa_section(results, SELECTED))
    assert "The best variant on the held-out split, var_moments, passes the gate" in text and "Holm p" in text
    assert "majority share, seeds 0-2: –, –, –." in text  # fabricated runs carry no per-client scores


def test_the_section_gives_the_gates_verdict_beside_the_finals():
    results = _variants({r.name: 0.7 for r in df.variants(LAM)})
    text = "\n".join(rf.dp_fedpa_section(results, SELECTED))
    assert "does not pass the declared gate" in text and "its finals are not all in" in text
    assert rf.dp_fedpa_section({}, SELECTED) == [] and rf.dp_fedpa_section(results, None) == []
