"""Issue 59 §3's cross-device part as declared: N clients and K a round from the declaration, the reduced trainable
set with the head federated, the dev set, each method at its main-cell selection; a DP run exists only once its
method's no-DP run is in, with the clip the privacy stage's median rule reads from that run; the report's bound
K/(z√D) against D counted here by hand; and the part's CPU price."""

from __future__ import annotations

import math

import pytest

from research.study import report_dp_regime as rr
from research.study import sst2_dp_device as dd
from research.study import sst2_dp_regime as dr

SELECTED = {"methods": {
    "fedpa": {"method": "fedpa", "optimizer": "AdamW", "lr": 2e-3, "lam": 0.01},
    "fedit": {"method": "fedit", "optimizer": "AdamW", "lr": 5e-3, "lam": None},
    "ffa_lora": {"method": "ffa_lora", "optimizer": "AdamW", "lr": 1e-2, "lam": None},
}}  # fmt: skip


def _opts(run) -> dict[str, str]:
    return dict(zip(run.opts[::2], run.opts[1::2]))


def _result(run, acc: float, norms: list[float], privacy: dict | None = None) -> dict:
    key = "delta_norm_mean" if run.method == "fedpa" else "change_norm_mean"
    return {"cell": run.name, "seed": run.seed, "opts": list(run.opts), "seconds": 3000.0, "cpu_seconds": 2940.0,
            "rounds": {str(run.rounds - 1): {"val_acc": acc}}, "privacy": privacy,
            "diagnostics": [{key: v, "delta_norm_mean" if key != "delta_norm_mean" else "change_norm_mean": 99.0}
                            for v in norms]}  # fmt: skip


def test_the_no_dp_runs_are_the_declared_federation_at_each_methods_selection():
    plain, private = dd.runs(SELECTED, {})
    assert [r.method for r in plain] == ["fedpa", "fedit", "ffa_lora", "fedsvd"] and private == []
    for run in plain:
        o = _opts(run)
        assert (o["federate.client_num"], o["federate.sample_client_num"]) == ("2000", "400")
        assert o["data.splitter_args"] == "[{'alpha': 1}]" and run.rounds == 30 and run.seed == 0
        assert o["personalization.local_param"] == "[]" and o["model.seqcls.layers_to_transform"] == "[4, 5]"
        assert o["data.glue_holdout"] == "0" and "fedpa.dp_mode" not in o  # the dev set, no DP
        assert o["train.local_update_steps"] == "1" and run.stage == dr.STAGE
    lrs = {r.method: _opts(r)["train.optimizer.lr"] for r in plain}
    assert lrs == {"fedpa": "0.002", "fedit": "0.005", "ffa_lora": "0.01", "fedsvd": "0.01"}  # FedSVD: FFA-LoRA's
    assert _opts(plain[0])["fedpa.lam"] == "0.01"


def test_a_dp_run_waits_for_its_no_dp_run_and_clips_at_its_median_contribution():
    plain, _ = dd.runs(SELECTED, {})
    fedpa, fedit = plain[0], plain[1]
    ffa = plain[2]
    results = {fedpa.key: _result(fedpa, 0.8, [3.0, 1.0, 2.0, 10.0]), fedit.key: _result(fedit, 0.8, [0.5, 0.7, 0.9]),
               ffa.key: _result(ffa, 0.5424, [0.5])}  # fmt: skip
    _, private = dd.runs(SELECTED, results)
    # the amendment: FFA-LoRA's run ended within two standard errors of one label (0.5092 + 0.0339), so no DP run
    assert [r.name for r in private] == ["device_fedpa_dp", "device_fedit_dp"]
    results[ffa.key] = _result(ffa, 0.5436, [0.5])
    names = [r.name for r in dd.runs(SELECTED, results)[1]]
    assert names == ["device_fedpa_dp", "device_fedit_dp", "device_ffa_lora_dp"]
    clips = {r.method: _opts(r)["fedpa.dp_clip"] for r in private}
    assert clips == {"fedpa": "2.5", "fedit": "0.7"}  # the median of each method's own norm (fedpa: ||s B A||)
    for run, base in zip(private, plain):
        o = _opts(run)
        assert (o["fedpa.dp_mode"], o["fedpa.dp_epsilon"]) == ("client", "8")
        assert run.opts[: len(base.opts)] == base.opts  # the same run otherwise


def test_the_report_bounds_the_signal_with_d_counted_by_hand():
    plain, _ = dd.runs(SELECTED, {})
    fedit = plain[1]
    results = {fedit.key: _result(fedit, 0.8123, [0.7])}
    _, private = dd.runs(SELECTED, results)
    results[private[0].key] = _result(private[0], 0.7001, [0.7], {"dp_noise_multiplier": 2.5, "dp_clip": 0.7,
                                                                  "dp_epsilon": 7.98})  # fmt: skip
    text = "\n".join(rr.device_lines(results, plain, private))
    # fedit releases B and A of query and value on two layers (r = 4, 384 x 384) and the head (384 x 2 + 2)
    D = 2 * 2 * 4 * (384 + 384) + 384 * 2 + 2
    row = next(line for line in text.splitlines() if line.startswith("| fedit |"))
    bound = 400 / (2.5 * math.sqrt(D))
    assert row == f"| fedit | 0.8123 | 0.7001 | 0.7 | 2.5 | {D:,} | {bound:.3g} | 7.98 | 49 min, 49 min |"
    # FedPA-LoRA's contribution is the product: d x k a module
    assert rr.released_size("fedpa") == 4 * 384 * 384 + 770 and rr.released_size("fedsvd") == 4 * 4 * 384 + 770
    assert f"| fedpa | not run yet | not run yet | – | – | {4 * 384 * 384 + 770:,} | – | – | –, – |" in text
    results[plain[0].key] = _result(plain[0], 0.5092, [0.5])  # at one label: its DP run is not made, and says so
    text = "\n".join(rr.device_lines(results, plain, dd.runs(SELECTED, results)[1]))
    assert "| fedpa | 0.5092 | not made: no DP run of a method that did not learn without DP |" in text


def test_the_part_is_priced_by_clients_set_up_and_turns_taken():
    run = dd.runs(SELECTED, {})[0][1]
    turns = dd.CLIENTS * dd.SETUP_SECONDS + dd.SAMPLED * dd.ROUNDS * dd.TURN_SECONDS
    assert dr.cpu_seconds(run) == pytest.approx(turns + (dd.ROUNDS // dd.EVERY + 1) * dd.EVAL_SECONDS)
    assert dd.part_seconds() == pytest.approx(8 * dr.cpu_seconds(run))
