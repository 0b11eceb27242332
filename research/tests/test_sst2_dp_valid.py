"""The dpvalid stage's declaration: every DP run keeps the head inside the guarantee, the search's parts follow one
another, the gate keeps the finals back, and each final has its no-DP run in the same head treatment."""

from __future__ import annotations

from research.study import sst2_dp_valid as v
from research.study import sst2_protocol as sp


def _opts(run):
    return dict(zip(run.opts[::2], run.opts[1::2]))


def _result(value: float) -> dict:
    return {"rounds": {"30": {"val_acc": value}, "60": {"val_acc": value}}}


def test_no_run_of_the_stage_trains_a_head_outside_the_mechanism():
    point = v.Valid("frozen", 0.01, 5e-3)
    every = [*v.search_1(), *v.search_2(point), *v.final_runs(point, 0.01), *v.diagnostic_runs(point, 0.01)]
    for run in every:
        o = _opts(run)
        assert o.get("fedpa.dp_local_tensors", "noised") in ("noised", "frozen"), run.key
        assert o["personalization.local_param"] == "['classifier']"
        if o.get("fedpa.dp_mode") == "sample" and "fedpa.dp_epsilon" in o:
            assert (o["fedpa.dp_sampling"], o["fedpa.dp_accountant"], o["fedpa.dp_epsilon"]) == ("poisson", "pld", "8")
    assert {_opts(r).get("data.glue_holdout") for r in v.search_1()} == {f"{sp.HOLDOUT:g}"}  # never the dev set
    assert {_opts(r)["data.glue_holdout"] for r in v.final_runs(point, 0.01)} == {"0"}


PART_E = "dp valid: part E′, FedPA-LoRA's own adapters cross-device"


MAIN = {"methods": {"fedpa": {"method": "fedpa", "lam": 0.01, "optimizer": "AdamW", "lr": 0.002}}}


def test_the_search_then_the_gate_then_the_finals():
    main = MAIN
    parts = v.runs(main, {})
    assert [name for name, _ in parts] == ["dp valid: search S1 (head, clip)", PART_E] and len(parts[0][1]) == 4
    assert [name for name, _ in v.runs(main, {r.key: _result(0.7) for r in v.search_1()})][-1] == PART_E
    results = {r.key: _result(0.70 + 0.01 * i) for i, r in enumerate(v.search_1())}  # frozen_c0.01 best: 0.73
    parts = dict(v.runs(main, results))
    assert [r.name for r in parts["dp valid: search S2 (rate)"]] == ["search_frozen_c0.01_lr0.002",
                                                                     "search_frozen_c0.01_lr0.01"]  # fmt: skip
    results |= {r.key: _result(0.70) for r in parts["dp valid: search S2 (rate)"]}
    assert "dp valid: finals" not in dict(v.runs(main, results))  # 0.73 is below the gate
    results[v.search_1()[3].key] = _result(0.80)
    parts = dict(v.runs(main, results))
    finals = parts["dp valid: finals"]
    assert len(finals) == 3 * 4 * 2 + 2 and len(parts["dp valid: diagnostics (not selecting)"]) == 5
    off = _opts(next(r for r in finals if r.name == "fedit"))
    assert off["fedpa.dp_local_tensors"] == "frozen" and float(off["fedpa.dp_clip"]) == v.OFF_CLIP
    assert "fedpa.dp_epsilon" not in off and float(off["fedpa.dp_noise_multiplier"]) == v.OFF_Z


def test_a_noised_heads_run_without_dp_is_plain_training():
    off = dict(zip(v.Valid("noised", 0.1, 5e-3).off_opts()[::2], v.Valid("noised", 0.1, 5e-3).off_opts()[1::2]))
    assert "fedpa.dp_mode" not in off


def test_part_e_prime_scores_fedpa_own_adapters_and_takes_its_clip_from_part_e():
    from research.study import sst2_dp_device as dd

    main = MAIN
    plain = dict(v.runs(main, {}))[PART_E]
    assert [r.name for r in plain] == ["device_fedpa_own"]  # the DP run waits for part E's clip
    assert _opts(plain[0])["fedpa.eval_local"] == "True" and _opts(plain[0])["federate.client_num"] == "2000"
    part_e = dd.plain_run(main, "fedpa")
    assert {k: x for k, x in _opts(plain[0]).items() if k != "fedpa.eval_local"} == {
        k: x for k, x in _opts(part_e).items() if k != "fedpa.eval_local"}  # nothing else changed
    results = {part_e.key: {"diagnostics": [{"delta_norm_mean": x} for x in (0.2, 0.5, 0.9)]}}
    private = dict(v.runs(main, results))[PART_E][1]
    o = _opts(private)
    assert (o["fedpa.dp_mode"], o["fedpa.dp_epsilon"], float(o["fedpa.dp_clip"])) == ("client", "8", 0.5)


def _final(**metrics) -> dict:
    return {"rounds": {119: metrics}}


def test_refit_runs_are_the_seed_0_finals_scored_with_refitted_heads_too():
    point = v.Valid("frozen", 0.01, 1e-2)
    finals = {r.name: r for r in v.final_runs(point, 0.01) if r.seed == 0}
    for run in (r for r in v.diagnostic_runs(point, 0.01) if r.name.endswith("_refit")):
        final = finals[run.name[: -len("_refit")]]
        assert run.opts == (*final.opts, "fedpa.eval_refit_head", "True") and run.method == final.method
        assert (run.seed, run.rounds) == (0, final.rounds)


def test_only_the_diagnostics_that_recover_half_the_gap_run_again():
    point, lam = v.Valid("frozen", 0.01, 1e-2), 0.01
    key = {r.name: r.key for r in (*v.final_runs(point, lam), *v.diagnostic_runs(point, lam)) if r.seed == 0}
    results = {key["fedit_dp"]: _final(val_acc=0.80), key["fedpa_dp"]: _final(val_acc=0.50),  # the gap: 0.30
               key["fedpa_dp_lam1"]: _final(val_acc=0.66),  # recovers 0.16 >= 0.15
               key["fedpa_dp_lam0.1"]: _final(val_acc=0.64),  # 0.14: not enough
               key["fedpa_no_preservation_dp"]: _final(val_acc=0.40),
               key["fedpa_dp_refit"]: _final(**{"val_acc": 0.5, "refit.val_acc": 0.60, "local.refit.val_acc": 0.79}),
               key["fedit_dp_refit"]: _final(**{"val_acc": 0.8, "refit.val_acc": 0.82})}  # fmt: skip
    assert v.closing(results, point, lam) == ["fedpa_dp_lam1", "fedpa_dp_refit"]
    assert v.refit_metric(results, point, lam) == "local.refit.val_acc"
    more = v.followup_runs(results, point, lam)
    assert sorted((r.name, r.seed) for r in more) == [(n, s) for n in ("fedit_dp_refit", "fedpa_dp_lam1",
                                                                       "fedpa_dp_refit") for s in (1, 2)]  # fmt: skip
    assert "dp valid: the diagnostics that close the gap, seeds 1-2" not in dict(v.runs(MAIN, {}))
    values = v.followup_values(results, point, lam)
    assert values == {"fedit_dp": {0: 0.80}, "fedpa_dp_lam1": {0: 0.66}, "fedpa_dp_refit": {0: 0.79},
                      "fedit_dp_refit": {0: 0.82}}  # fmt: skip
    # FedIT below FedPA-LoRA: no gap to close
    results[key["fedit_dp"]] = _final(val_acc=0.40)
    assert v.closing(results, point, lam) == [] and v.followup_runs(results, point, lam) == []
