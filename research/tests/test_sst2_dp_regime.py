"""Issue 59's ``dpregime`` stage as declared: the search reads only the held-out split at the finals' noise, the
selection follows the stated rule on fabricated scores, the finals run exactly the selected regime, and the CPU
estimate prices runs by the records they train on."""

from __future__ import annotations

import itertools

import pytest

from research.study import protocol_results as pr
from research.study import sst2_dp_regime as dr
from research.study import sst2_protocol as sp

SELECTED = {"methods": {m: {"method": m, "optimizer": "AdamW", "lr": 5e-3, "lam": 0.01 if m == "fedpa" else None}
                        for m in ("fedpa", "fedit", "ffa_lora")}}  # fmt: skip


def _opts(run: sp.Run) -> dict[str, str]:
    return dict(zip(run.opts[::2], run.opts[1::2]))


def _result(run: sp.Run, held_out: float) -> dict:
    rounds = {r: {"val_acc": held_out} for r in range(run.rounds // dr.EVALS, run.rounds + 1, run.rounds // dr.EVALS)}
    return {"cell": run.name, "seed": run.seed, "rounds": rounds, "rounds_planned": run.rounds, "opts": list(run.opts)}


def test_part_a_covers_batch_steps_and_head_on_the_held_out_split_at_the_finals_noise():
    a = dr.search_a()
    cells = {(int(_opts(r)["dataloader.batch_size"]), int(_opts(r)["train.local_update_steps"]),
              _opts(r)["personalization.local_param"]) for r in a}  # fmt: skip
    assert cells == set(itertools.product((256, 1024), (1, 2), ("['classifier']", "[]"))) and len(a) == 8
    for run in a:
        o = _opts(run)
        assert run.method == "fedit" and run.seed == 0
        assert o["data.glue_holdout"] == "0.015" and o["fedpa.eval_local"] == "False"  # never the dev set
        # the noise of a final run: the same epsilon, sampling, accountant, clip and horizon of 120 steps a client
        assert (o["fedpa.dp_mode"], o["fedpa.dp_epsilon"], o["fedpa.dp_sampling"], o["fedpa.dp_accountant"]) == (
            "sample", "8", "poisson", "pld")  # fmt: skip
        assert int(o["fedpa.dp_horizon"]) == run.rounds and run.rounds * int(o["train.local_update_steps"]) == 120
        # the head is clipped and noised exactly when it is federated
        local = o["personalization.local_param"] == "['classifier']"
        assert (o.get("fedpa.dp_local_tensors") == "plain") == local
        assert o["model.seqcls.prefix_cache"] == "True" and o["model.seqcls.layers_to_transform"] == "[4, 5]"
        assert int(o["eval.freq"]) * dr.EVALS == run.rounds


def test_the_search_selects_by_held_out_score_then_tunes_the_optimizer_then_the_clip_and_the_finals_use_its_regime():
    results: dict = {}
    a = dr.search_a()
    assert [part for part, _ in dr.runs(SELECTED, results)] == [
        "dp regime: search A (b, tau, head)", "dp regime: cross-device, no DP", "dp regime: cross-device, DP"]
    # b = 1,024, tau = 2, federated head is best; a tie with a later run keeps the earlier one
    for run in a:
        o = _opts(run)
        best = (o["dataloader.batch_size"], o["train.local_update_steps"], o["personalization.local_param"]) == (
            "1024", "2", "[]")  # fmt: skip
        results[run.key] = _result(run, 0.85 if best else 0.76)
    parts = dict(dr.runs(SELECTED, results))
    b = parts["dp regime: search B (optimizer, layers)"]
    assert len(b) == 3 and "dp regime: finals" not in parts  # B waits for its own runs
    assert {(_opts(r)["dataloader.batch_size"], _opts(r)["train.local_update_steps"]) for r in b} == {("1024", "2")}
    tried = {(o["train.optimizer.type"], o["train.optimizer.lr"], o["model.seqcls.layers_to_transform"])
             for o in map(_opts, b)}  # fmt: skip
    assert tried | {("AdamW", "0.0005", "[4, 5]")} == {
        (o, f"{lr:g}", str(list(layers))) for o, lr in dr.OPTIMIZERS for layers in dr.B_LAYERS
    }  # the amendment dropped B's top-layer half
    assert all(_opts(r)["fedpa.dp_clip"] == "1" for r in [*a, *b])
    sgd = [r for r in b if _opts(r)["train.optimizer.type"] == "SGD"]
    assert sgd and all(_opts(r)["train.optimizer.momentum"] == "0.9" for r in sgd)
    for run in b:
        results[run.key] = _result(run, 0.87 if _opts(run)["train.optimizer.lr"] == "0.001" else 0.80)
    parts = dict(dr.runs(SELECTED, results))
    c = parts["dp regime: search C (clip, b)"]
    assert "dp regime: finals" not in parts  # C waits for its own runs
    # C: every clip at b = 256 (amendment G dropped b = 1,024) at the best of A and B, nothing else changed
    assert {(_opts(r)["fedpa.dp_clip"], _opts(r)["dataloader.batch_size"]) for r in c} == {
        ("0.1", "256"), ("0.01", "256")} and len(c) == 2
    kept = ("personalization.local_param", "train.local_update_steps", "train.optimizer.lr",
            "model.seqcls.layers_to_transform")
    assert {tuple(_opts(r)[k] for k in kept) for r in c} == {("[]", "2", "0.001", "[4, 5]")}
    # D, not selecting: at the best of A and B (not C's b), without DP and at z = 0.01 with C = 1 (G dropped C = 0.01)
    d = parts["dp regime: diagnostics D (not selecting)"]
    assert [r.name for r in d] == ["diag_b1024_tau2_federated_l45_adamw0.001_nodp",
                                   "diag_b1024_tau2_federated_l45_adamw0.001_z0.01"]  # fmt: skip
    assert "fedpa.dp_mode" not in _opts(d[0]) and all(_opts(r)["data.glue_holdout"] == "0.015" for r in d)
    for run, clip in zip(d[1:], ("1",)):
        o = _opts(run)
        assert (o["fedpa.dp_mode"], o["fedpa.dp_noise_multiplier"], o["fedpa.dp_clip"]) == ("sample", "0.01", clip)
        assert "fedpa.dp_epsilon" not in o and o["fedpa.dp_sampling"] == "poisson"
    assert {tuple(_opts(r)[k] for k in kept) for r in d} == {("[]", "2", "0.001", "[4, 5]")}
    # F: AdamW at 5e-3 and 2e-3 under DP at C = 0.1, at the best of A and B (G dropped its run without DP)
    f = parts["dp regime: search F (learning rate)"]
    assert [r.name for r in f] == ["search_b1024_tau2_federated_l45_adamw0.005_c0.1",
                                   "search_b1024_tau2_federated_l45_adamw0.002_c0.1"]  # fmt: skip
    assert "dp regime: diagnostics F (not selecting)" not in parts
    assert all(_opts(r)["fedpa.dp_epsilon"] == "8" for r in f)
    for run in c:  # two runs tie at the best score: the first in declared order wins
        results[run.key] = _result(run, 0.90 if _opts(run)["fedpa.dp_clip"] == "0.1" else 0.80)
    assert "dp regime: finals" not in dict(dr.runs(SELECTED, results))  # the finals wait for F's runs too
    for run in d:  # a diagnostic never selects, however high it scores
        results[run.key] = _result(run, 0.99)
    for run in f:  # F ties C's best: C's run came first
        results[run.key] = _result(run, 0.90)
    (winner,) = [r for r in c if _opts(r)["fedpa.dp_clip"] == "0.1"]
    expected = dr.Regime(256, 2, "federated", (4, 5), "AdamW", 1e-3, 0.1)
    assert dr.selected_regime(results) == dr.regime_of(winner) == expected
    assert winner.name == "search_b256_tau2_federated_l45_adamw0.001_c0.1"
    finals = dict(dr.runs(SELECTED, results))["dp regime: finals"]
    cells = {r.name for r in finals}
    assert cells == {*dr.METHODS, *(f"{m}_dp" for m in dr.METHODS), "fedit_dp_replace", "central", "central_dp",
                     "central_dp_replace"}  # fmt: skip
    for run in finals:
        o = _opts(run)
        assert o["data.glue_holdout"] == "0" and o["fedpa.eval_local"] == "True"  # the dev set, both protocols
        assert (o["dataloader.batch_size"], o["train.local_update_steps"], o["train.optimizer.lr"]) == (
            "256", "2", "0.001")  # fmt: skip
        assert o["personalization.local_param"] == "[]" and run.rounds == 60
        assert ("fedpa.dp_mode" in o) == run.name.endswith(("_dp", "_dp_replace"))
        if run.name.endswith("_replace"):
            assert o["fedpa.dp_sampling"] == "wor" and o["fedpa.dp_epsilon"] == "8"
        # amendment H: a CPU forward takes 32 length-sorted records, DP-SGD's chunks under DP, the plain step's without
        assert (o.get("fedpa.dp_chunk"), o.get("model.seqcls.train_chunk")) == (
            ("32", None) if "fedpa.dp_mode" in o else (None, "32"))  # fmt: skip
        if "fedpa.dp_mode" in o:
            assert o["fedpa.dp_clip"] == "0.1"  # the selected clip
        if run.method == "fedpa":
            assert o["fedpa.lam"] == "0.01"
        central = run.name.startswith("central")
        assert (o.get("federate.client_num") == "1") == central and run.seed in ((0,) if central else (0, 1, 2))
    assert len(finals) == 3 * 9 + 3


EVERY = [dr.Regime(b, t, h, layers, o, lr, clip) for b in dr.BATCHES for t in dr.TAUS for h in dr.HEADS
         for layers in dr.LAYERS for o, lr in dr.OPTIMIZERS for clip in (dr.CLIP, *dr.CLIPS)]  # fmt: skip


@pytest.mark.parametrize("regime", EVERY[::7])
def test_a_regime_is_read_back_from_its_run_name(regime):
    assert dr.Regime.of(regime.name) == regime


def test_the_cpu_estimate_prices_records_not_rounds():
    a = {(int(_opts(r)["dataloader.batch_size"]), int(_opts(r)["train.local_update_steps"]), r.name): r
         for r in dr.search_a()}  # fmt: skip
    cost = {key[:2]: dr.cpu_seconds(run) for key, run in a.items()}
    fill = sum(dr.CLIENT_SIZES) * dr.SECONDS_PER_RECORD["prefix"]
    # the same 120 steps a client whatever tau; four times the records at b = 1,024 (no client under DP is smaller)
    assert cost[(256, 1)] == pytest.approx(cost[(256, 2)])
    assert cost[(1024, 1)] - fill > 3.5 * (cost[(256, 1)] - fill)
    # under DP the three clients under 1,000 sentences take no step
    run = next(iter(a.values()))
    seven = sum(1 for n in dr.CLIENT_SIZES if n >= dr.MIN_RECORDS)
    steps = seven * 256 * 120 * dr.SECONDS_PER_RECORD["dp"]
    assert dr.cpu_seconds(run) - fill == pytest.approx(steps, rel=0.05)
    low, high = dr.stage_hours()
    assert 0 < low < high


def test_the_runners_plan_and_pricing_include_the_stage(tmp_path):
    from research.study import sst2_compare as sc

    assert dr.STAGE in sp.STAGES
    runs = dr.search_a()
    assert sc.minutes_left(runs, {}) == pytest.approx(dr.minutes(runs, {}))
    # the committed protocol: its stages, then this one's parts once the selection exists
    stages = sc.plan(pr.load_results(sp.REPORT), sp.REPORT)
    names = [part for part, _ in stages]
    assert names[-1].startswith("dp fedpa") and "privacy: sample-level final" in dict(stages)  # then dpvalid's, dpfedpa's
    later = ("dp valid", "dp fedpa")
    assert names[max(i for i, n in enumerate(names) if not n.startswith(later))].startswith("dp regime")
    assert names[max(i for i, n in enumerate(names) if not n.startswith("dp fedpa"))].startswith("dp valid")
    assert not any(part.startswith("dp regime") for part, _ in sc.plan({}, tmp_path))
    # the committed runs' per-round rate ignores this stage's runs, whose rounds are of other sizes
    other = {"seconds": 100.0, "rounds_planned": 10, "opts": [], "stage": "final"}
    mine = {"seconds": 10_000.0, "rounds_planned": 10, "opts": [], "stage": dr.STAGE}
    assert sp.seconds_per_round({"a": other, "b": mine}) == 10.0
