"""The dpvalid stage's declaration: every DP run keeps the head inside the guarantee, the search's parts follow one
another, the gate keeps the finals back, and each final has its no-DP run in the same head treatment."""

from __future__ import annotations

from fs_fedpa.study import sst2_dp_valid as v
from fs_fedpa.study import sst2_protocol as sp


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
    assert len(finals) == 3 * 4 * 2 + 2 and len(parts["dp valid: diagnostics (not selecting)"]) == 3
    off = _opts(next(r for r in finals if r.name == "fedit"))
    assert off["fedpa.dp_local_tensors"] == "frozen" and float(off["fedpa.dp_clip"]) == v.OFF_CLIP
    assert "fedpa.dp_epsilon" not in off and float(off["fedpa.dp_noise_multiplier"]) == v.OFF_Z


def test_a_noised_heads_run_without_dp_is_plain_training():
    off = dict(zip(v.Valid("noised", 0.1, 5e-3).off_opts()[::2], v.Valid("noised", 0.1, 5e-3).off_opts()[1::2]))
    assert "fedpa.dp_mode" not in off


def test_part_e_prime_scores_fedpa_own_adapters_and_takes_its_clip_from_part_e():
    from fs_fedpa.study import sst2_dp_device as dd

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
