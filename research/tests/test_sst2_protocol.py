"""The SST-2 protocol's plan (research.study.sst2_compare) on fabricated results: held-out tuning, the selection
written to selected.json and final runs that use exactly its values; and the committed results, where present."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from types import SimpleNamespace

import pytest

from research.study import sst2_privacy as spriv
from research.study import protocol_results as pr
from research.study import sst2_protocol as sp
from research.study import sst2_compare as sc

COMMITTED = Path(__file__).resolve().parents[2] / sp.REPORT


def _result(run: sp.Run, accs: dict[int, float]) -> dict:
    return {
        "cell": run.name,
        "method": run.method,
        "opts": list(run.cell().opts),
        "seed": run.seed,
        "seconds": 10.0 * run.rounds,
        "rounds_planned": run.rounds,
        "rounds": {r: {"val_acc": a, "local.val_acc": a} for r, a in accs.items()},
        "diagnostics": [],
    }


def _opts(run: sp.Run) -> dict[str, str]:
    return dict(zip(run.opts[::2], run.opts[1::2]))


def _tuning_score(run: sp.Run) -> float:
    """A fabricated held-out score with a unique best per method: FedPA at lam 0.5 and SGD 0.1, the others at
    AdamW 5e-3."""
    o = _opts(run)
    best = ("SGD", "0.1") if run.method == "fedpa" else ("AdamW", "0.005")
    score = 0.8 + 0.05 * ((o["train.optimizer.type"], o["train.optimizer.lr"]) == best)
    return score + 0.01 * (o.get("fedpa.lam") == "0.5")


def test_tuning_never_reads_the_dev_set_and_the_final_runs_use_exactly_the_selected_values(tmp_path):
    results: dict = {}
    pilot = sp.pilot_run()
    results[pilot.key] = _result(pilot, {t: min(0.5 + 0.02 * t, 0.85) for t in range(2, 49, 2)})
    stages = dict(sp.plan(results, tmp_path))
    T = sp.pilot_T(results[pilot.key])
    assert T == 24 and set(stages) == {"pilot", "tune"}
    # the lr sweep of FedPA waits for its λ sweep at the pilot's rate
    assert {_opts(r)["train.optimizer.lr"] for r in stages["tune"] if r.method == "fedpa"} == {"0.002"}
    for _ in range(2):  # λ sweep, then everything else
        for run in dict(sp.plan(results, tmp_path))["tune"]:
            assert _opts(run)["data.glue_holdout"] == "0.015" and run.rounds == 12 and run.seed == 0
            results.setdefault(run.key, _result(run, {10: _tuning_score(run), 12: _tuning_score(run)}))
    stages = dict(sp.plan(results, tmp_path))
    selected = json.loads((tmp_path / "selected.json").read_text())  # read back from the file, as the runs do
    assert selected["T"] == T
    fedpa = selected["methods"]["fedpa"]
    assert (fedpa["optimizer"], fedpa["lr"], fedpa["lam"]) == ("SGD", 0.1, 0.5)
    assert {m: (c["optimizer"], c["lr"]) for m, c in selected["methods"].items() if m != "fedpa"} == {
        m: ("AdamW", 0.005) for m in sp.MAIN if m != "fedpa"
    }
    finals = stages["final"]
    assert {(r.method, r.seed) for r in finals} == {(m, s) for m in sp.MAIN for s in sp.SEEDS}
    for run in finals:
        o, choice = _opts(run), selected["methods"][run.method]
        assert (o["train.optimizer.type"], float(o["train.optimizer.lr"])) == (choice["optimizer"], choice["lr"])
        assert float(o.get("fedpa.lam", "nan")) == choice["lam"] or choice["lam"] is None
        assert o["data.glue_holdout"] == "0" and run.rounds == T
    assert _opts(next(r for r in finals if r.method == "fedrot_lora"))["fedpa.rotation_strength"] == "0.6"
    central = next(r for r in finals if r.method == "centralized").cell().opts
    assert central[:6] == (
        "federate.client_num",
        "1",
        "federate.sample_client_num",
        "1",
        "train.local_update_steps",
        "100",
    )


def test_later_stages_follow_the_final_paired_intervals(tmp_path):
    results: dict = {}
    selected = {
        "T": 4,
        "methods": {m: {"method": m, "optimizer": "AdamW", "lr": 2e-3, "lam": 0.5 if m == "fedpa" else None}
                    for m in sp.MAIN},
    }  # fmt: skip
    # fedpa beats fedit clearly and ties flexlora (+0.01, -0.01, +0.02)
    gaps = {"fedit": (0.05, 0.06, 0.055), "flexlora": (0.01, -0.01, 0.02)}
    for run in sp.final_runs(selected, 4):
        acc = 0.85 - gaps.get(run.method, (0.1, 0.1, 0.11))[run.seed] if run.method != "fedpa" else 0.85
        results[run.key] = _result(run, {4: acc})
    rows = pr.paired_rows(results, "val_acc")
    assert rows["fedit"]["verdict"] == "wins" and rows["flexlora"]["verdict"] == "ties"
    assert rows["fedit"]["mean"] == pytest.approx(0.055)
    assert sp.strongest(results) == ["flexlora", "fedit", "ffa_lora"]
    hetero = {r.method: _opts(r) for r in sp.extra_runs(selected, 4, ["flexlora"]) if r.stage == "hetero"}
    assert set(hetero) == {"fedpa", "flexlora", "hetlora", "flora", "fed_plora", "ravan"}
    assert all(o["model.seqcls.r"] == "16" and o["fedpa.client_ranks"] == "[2, 4, 16]" for o in hetero.values())
    # the same penalty per unit of update as the tuned r = 4 cell: lambda * (s(16) / s(4))^2 with s(r) = alpha / r
    assert float(hetero["fedpa"]["fedpa.lam"]) == pytest.approx(0.5 * ((8 / 16) / (8 / 4)) ** 2)
    assert hetero["fed_plora"]["fedpa.reference_ranks"] == "[16, 16, 16]"  # all R modules to every client
    assert hetero["ravan"]["fedpa.reference_ranks"] == "[16, 16, 16]"  # all heads to every client
    assert hetero["flexlora"]["fedpa.reference_ranks"] == "[2, 4, 16]"
    order = [r.name for r in sp.extra_runs(selected, 4, ["flexlora"]) if r.seed == 0]
    assert order[:2] == ["fedpa_no_preservation", "fedpa_lam0"]  # the ablation's mechanism cells run first
    adaptive = {r.name: _opts(r) for r in sp.extra_runs(selected, 4, ["flexlora"]) if r.stage == "adaptive"}
    assert {n: o["fedpa.adaptive_lam"] for n, o in adaptive.items()} == {
        "fedpa_adaptive_loss": "loss", "fedpa_adaptive_grad": "grad", "fedpa_adaptive_direction": "direction",
        "fedpa_adaptive_grad_scaled": "grad",
    }  # fmt: skip
    assert all(float(o["fedpa.lam"]) == 0.5 for o in adaptive.values())  # lambda_0: the selected lambda
    # the paper's rules keep its clip [0, 10]; the named variant scales it to lambda_0 (lambda_max / lambda_0 = 10)
    assert "fedpa.lam_max" not in adaptive["fedpa_adaptive_grad"]
    assert float(adaptive["fedpa_adaptive_grad_scaled"]["fedpa.lam_max"]) == pytest.approx(10 * 0.5)


@pytest.mark.skipif(not (COMMITTED / "selected.json").is_file(), reason="no committed selection yet")
def test_committed_final_runs_used_the_committed_selection():
    selected = json.loads((COMMITTED / "selected.json").read_text())
    results = pr.load_results(COMMITTED)
    finals = [r for k, r in results.items() if k.startswith("final/")]
    for run in finals:
        opts = dict(zip(run["opts"][::2], run["opts"][1::2]))
        choice = selected["methods"][run["cell"]]
        assert (
            opts["train.optimizer.type"] == choice["optimizer"] and float(opts["train.optimizer.lr"]) == choice["lr"]
        )
        if choice.get("lam") is not None:
            assert float(opts["fedpa.lam"]) == choice["lam"]


def fake_fs_runs(monkeypatch, failing: tuple[str, ...] = ()) -> list:
    """Replace FS runs by instant ones (6 s, held-out accuracy 0.8; the cells in ``failing`` fail); returns the list
    of ``(cell, opts)`` they are called with."""
    from research.harness import compare

    calls = []

    def run_one(cfg, cell, seed, out, opts, rounds):
        calls.append((cell.name, opts))
        if cell.name in failing:
            raise RuntimeError(f"{cell.name} seed 0 failed (exit 1)")
        out.mkdir(parents=True, exist_ok=True)

    def collect(out):
        return {"cell": out.name[:-3], "seed": 0, "seconds": 6.0, "rounds": {"2": {"val_acc": 0.8}}, "diagnostics": []}

    monkeypatch.setattr(compare, "run_one", run_one)
    monkeypatch.setattr(compare, "collect", collect)
    return calls


def test_runs_execute_in_parallel_commit_each_result_and_leave_failures_for_the_next_call(tmp_path, monkeypatch):
    calls = fake_fs_runs(monkeypatch, failing=("fedit",))
    runs = [sp.Run("tune", m, m, (), 0, 2) for m in ("fedpa", "fedit", "flexlora")]
    results, budget = {}, {"ran": 0.0, "stop_at": 0.0}
    fs_opts = ("use_gpu", "True")
    done = sc.execute(runs, results, tmp_path, tmp_path / "work", tmp_path, budget, jobs=2, fs_opts=fs_opts)
    assert done == 2 and sorted(results) == ["tune/fedpa_s0", "tune/flexlora_s0"] and budget["ran"] == 12.0
    assert sorted(p.name for p in (tmp_path / "runs" / "tune").iterdir()) == ["fedpa_s0.json", "flexlora_s0.json"]
    assert all(opts[-2:] == ["use_gpu", "True"] for _, opts in calls)
    assert json.loads((tmp_path / "runs" / "tune" / "fedpa_s0.json").read_text())["fs_opts"] == ["use_gpu", "True"]
    assert pr.load_results(tmp_path)["tune/fedpa_s0"]["rounds"] == {2: {"val_acc": 0.8}}  # committed, read back


@pytest.mark.parametrize("jobs", [1, 2])
def test_the_hours_budget_stops_after_the_runs_under_way_and_keeps_their_results(tmp_path, monkeypatch, jobs):
    calls = fake_fs_runs(monkeypatch)
    clock = iter([0.0] * jobs)  # the first `jobs` runs start before the budget is spent, every later one after

    monkeypatch.setattr(sc, "time", SimpleNamespace(time=lambda: next(clock, 2.0)))  # this module's clock only
    runs = [sp.Run("tune", m, m, (), 0, 2) for m in ("fedpa", "fedit", "flexlora", "ffa_lora", "fedsa_lora")]
    results, budget = {}, {"ran": 0.0, "stop_at": 1.0}
    with pytest.raises(TimeoutError, match=rf"--hours spent; {5 - jobs} runs of this stage left"):
        sc.execute(runs, results, tmp_path, tmp_path / "work", tmp_path, budget, jobs=jobs)
    assert len(calls) == len(results) == jobs  # the runs under way finished and were kept; no other one started
    assert sorted(p.stem for p in (tmp_path / "runs" / "tune").iterdir()) == sorted(k[5:] for k in results)
    assert sc.execute(runs, results, tmp_path, tmp_path / "work", tmp_path, {"ran": 0.0, "stop_at": 0.0}) == 5 - jobs
    assert len(results) == 5  # the next call runs the rest


def test_the_report_states_a_verdict_per_baseline_from_the_committed_runs(tmp_path):
    from research.study.report import write_report

    selected = {"T": 4, "methods": {m: {"method": m, "optimizer": "AdamW", "lr": 2e-3, "lam": None} for m in sp.MAIN}}
    results = {}
    gaps = {"fedit": (0.05, 0.06, 0.055), "flexlora": (0.01, -0.01, 0.02), "ffa_lora": (-0.05, -0.06, -0.055)}
    for run in sp.final_runs(selected, 4):
        acc = 0.85 - gaps.get(run.method, (0.0, 0.0, 0.0))[run.seed] if run.method != "fedpa" else 0.85
        results[run.key] = _result(run, {4: acc})
    text = write_report(tmp_path, results, []).read_text()
    verdict = text.split("## Verdict", 1)[1].split("\n## ", 1)[0]
    assert "| fedit | +0.0550 [" in verdict and "FedPA wins" in verdict.split("| fedit |")[1].split("\n")[0]
    assert "FedPA ties" in verdict.split("| flexlora |")[1].split("\n")[0]
    assert "FedPA loses" in verdict.split("| ffa_lora |")[1].split("\n")[0]


def test_the_report_sets_each_cells_accuracy_beside_its_last_rounds_mechanism():
    from research.study.report_tuning import mechanism_section

    selected = {"T": 4, "methods": {m: {"method": m, "optimizer": "AdamW", "lr": 2e-3, "lam": None} for m in sp.MAIN}}
    cells = {"fedpa": (0.80, 3.0, 6.0), "fedit": (0.90, 9.0, 10.0), "fedsa_lora": (0.85, 0.0, 20.0)}
    results = {}
    for run in sp.final_runs(selected, 4, seeds=(0, 1)):
        if run.method in cells:
            acc, glob, delta = cells[run.method]
            res = _result(run, {4: acc + 0.01 * run.seed})
            early = {"global_update_norm": 100.0, "delta_norm_mean": 1.0}  # not the last round: must not show
            last = {"global_update_norm": glob * (1 + run.seed), "delta_norm_mean": delta * (1 + run.seed / 2)}
            res["diagnostics"] = [early, last]
            results[run.key] = res
    rows = [line.split(" | ") for line in mechanism_section(results) if line.startswith("| fed")]
    assert [r[0] for r in rows] == ["| fedit", "| fedsa_lora", "| fedpa"]  # best accuracy first
    fedit, fedsa, fedpa = rows
    # seeds 0 and 1: norms g, 2g and d, 1.5d; coherence is each seed's ratio, averaged (not a ratio of means)
    assert fedpa[2:6] == ["0.8050", "4.5", "7.5", f"{(3 / 6 + 6 / 9) / 2:.3g}"]
    assert fedit[2:6] == ["0.9050", "13.5", "12.5", f"{(9 / 10 + 18 / 15) / 2:.3g}"]
    assert fedsa[3] == "–" and fedsa[5] == "–"  # its server aggregates no product


def test_the_mechanism_table_takes_the_heavy_tailed_gradient_ratio_as_a_median_over_seeds():
    from research.study.report_tuning import mechanism_section

    selected = {"T": 4, "methods": {m: {"method": m, "optimizer": "AdamW", "lr": 2e-3, "lam": 0.01} for m in sp.MAIN}}
    results = {}
    for run in sp.final_runs(selected, 4, seeds=(0, 1, 2)):
        if run.method == "fedpa":
            res = _result(run, {4: 0.8})
            norm = (1.0, 2.0, 6.0)[run.seed]
            ratio = (2.0, 3.0, 60.0)[run.seed]  # one seed's near-zero task gradient
            res["diagnostics"] = [{"global_update_norm": norm, "grad_ratio_last_mean": ratio}]
            results[run.key] = res
    (row,) = [line.split(" | ") for line in mechanism_section(results) if line.startswith("| fedpa")]
    assert row[3] == "3" and row[-1] == "3 |"  # the norm: mean of 1, 2, 6; the ratio: median of 2, 3, 60


def test_a_run_records_the_cpu_time_its_process_reports_and_its_exit_status():
    import subprocess
    import sys

    from research.harness import compare

    burn = "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.4: pass\ntime.sleep(0.3)\n"
    burn += "print(time.process_time())"
    with subprocess.Popen([sys.executable, "-c", burn], stdout=subprocess.PIPE, text=True) as proc:
        reported = float(proc.stdout.read())
        cpu = compare._reap(proc)
    assert proc.returncode == 0 and reported >= 0.4
    assert reported <= cpu < reported + 0.3  # the interpreter's start-up is CPU too; the sleep is not
    with subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"]) as proc:
        compare._reap(proc)
    assert proc.returncode == 3


def test_time_spent_reports_wall_time_and_cpu_time_where_recorded():
    results = {"a": {"seconds": 3600.0, "cpu_seconds": 5400.0}, "b": {"seconds": 1800.0}}
    assert pr.time_spent(results) == "1.50 h of wall time, 1.50 CPU-h on the 1 of 2 runs that record it"
    assert pr.time_spent({"b": {"seconds": 1800.0}}) == "0.50 h of wall time"
    # two runs side by side (--jobs 2) share the machine: 1.5 h of wall time is 0.75 h of it
    assert pr.time_spent({"a": {"seconds": 3600.0, "jobs": 2}, "b": {"seconds": 1800.0, "jobs": 2}}) == (
        "1.50 h of wall time (0.75 h of machine time: wall time / runs side by side)"
    )


def test_parallel_jobs_split_the_cpus_unless_the_user_set_the_threads():
    assert sc.with_threads([], 1, 2) == []
    assert sc.with_threads(["use_gpu", "False"], 2, 2) == ["use_gpu", "False", "fedpa.num_threads", "1"]
    assert sc.with_threads([], 4, 16) == ["fedpa.num_threads", "4"]
    assert sc.with_threads([], 3, 2) == ["fedpa.num_threads", "1"]
    assert sc.with_threads(["fedpa.num_threads", "2"], 2, 2) == ["fedpa.num_threads", "2"]


def test_the_time_estimate_counts_machine_time_per_round_whatever_the_jobs():
    results = {"a": {"seconds": 200.0, "rounds_planned": 10, "jobs": 2}, "b": {"seconds": 100.0, "rounds_planned": 10}}
    assert sp.seconds_per_round(results) == 10.0  # 200 s of wall time shared by two runs = 10 s a round each
    assert sp.seconds_per_round({}) == sp.SECONDS_PER_ROUND
    gpu = {"seconds": 12.0, "rounds_planned": 10, "jobs": 12, "fs_opts": ["use_gpu", "True", "device", "0"]}
    assert sp.seconds_per_round({**results, "c": gpu, "d": gpu, "e": gpu}) == 10.0  # a GPU host's runs: not this CPU


def test_dp_sgd_runs_are_priced_by_their_own_rounds():
    plain = {"seconds": 100.0, "rounds_planned": 10, "opts": ["fedpa.lam", "0.01"]}
    assert sp.seconds_per_round({"a": plain}, sample_dp=True) == 10.0 * sp.DP_SGD_FACTOR  # none run yet
    dp = {"seconds": 400.0, "rounds_planned": 10, "opts": ["fedpa.dp_mode", "sample", "fedpa.dp_clip", "1"]}
    results = {"a": plain, "b": dp}
    assert (sp.seconds_per_round(results), sp.seconds_per_round(results, sample_dp=True)) == (10.0, 40.0)
    runs = [sp.Run("privacy", "x", "fedpa", ("fedpa.dp_mode", "sample"), 0, 3),
            sp.Run("privacy", "y", "fedpa", (), 0, 5)]  # fmt: skip
    assert sp.minutes_left(runs, results) == (3 * 40.0 + 5 * 10.0) / 60
    results[runs[0].key] = dp  # a finished run costs nothing more
    assert sp.minutes_left(runs, results) == 5 * 10.0 / 60


def test_the_lambda_table_shows_fedpas_sweep_at_the_pilot_rate_beside_fedit_and_local_training():
    from research.study.report_tuning import lambda_section

    runs = sp.tune_runs(4, 0.1)
    results = {}
    for run in runs:
        o = _opts(run)
        lam = float(o.get("fedpa.lam", 0.0))
        res = _result(run, {1: 0.70, 2: 0.90 - lam / 100})
        # the last round's update shrinks with lambda; an earlier round must not show
        res["diagnostics"] = [{"delta_norm_mean": 99.0}, {"delta_norm_mean": 8.0 / (1 + lam), "drift_rel_mean": lam}]
        results[run.key] = res
    del results[f"tune/{sp.tune_name('fedpa', *sp.PILOT_LR, 0.5)}_s0"]  # a run still to do has no row
    rows = [line.split(" | ") for line in lambda_section(results, [("tune", runs)]) if line.startswith("| ")][1:]
    lams = [lam for lam in sp.LAM_GRID if lam != 0.5]
    assert [r[0] for r in rows] == [f"| fedpa, λ {lam:g}" for lam in lams] + ["| fedit", "| local_only"]
    for row, lam in zip(rows, lams):
        assert abs(float(row[1]) - (0.70 + 0.90 - lam / 100) / 2) < 6e-5  # the mean of the last two evaluations
        assert row[3] == f"{8.0 / (1 + lam):.3g}" and row[5] == f"{lam:.3g}"
    assert rows[-1][3] == "8" and rows[-1][2] == "–"  # no global update diagnostic recorded: a dash, not a zero
    assert lambda_section({}, [("tune", runs)]) == []


def test_selections_at_the_grids_top_are_checked_one_step_above_without_changing_the_selection(tmp_path):
    from research.study.report_tuning import edge_section

    results: dict = {}
    pilot = sp.pilot_run()
    results[pilot.key] = _result(pilot, {t: min(0.5 + 0.02 * t, 0.85) for t in range(2, 49, 2)})
    for _ in range(2):  # the tuning stage as in the test above: FedPA at SGD 0.1, every other method at AdamW 5e-3
        for run in dict(sp.plan(results, tmp_path))["tune"]:
            results.setdefault(run.key, _result(run, {10: _tuning_score(run), 12: _tuning_score(run)}))
    sp.plan(results, tmp_path)  # writes the selection
    selected_file = tmp_path / "selected.json"
    selected = json.loads(selected_file.read_text())
    selected["methods"]["fedrot_lora"].update(lr=2e-3)  # one baseline inside the grid: it gets no edge run
    selected_file.write_text(json.dumps(selected))
    for run in dict(sp.plan(results, tmp_path))["final"]:
        results[run.key] = _result(run, {selected["T"]: 0.85 + 0.001 * run.seed})
    stages = sp.plan(results, tmp_path)
    assert [s for s, _ in stages][-7:] == [
        "final, more seeds",
        "tuning grid edge",
        "beyond the main cell",
        "head asymmetry",
        "long horizon",
        "partial participation",
        "client splits",
    ]
    from research.study.sst2_compare import plan as runner_plan

    after = [s for s, _ in runner_plan(results, tmp_path)][len(stages) :]  # the runner appends the later stages
    assert after[:3] == ["privacy: sample-level tuning", "privacy: client level, no DP", "privacy: client level, DP"]
    assert len(dict(stages)["client splits"]) == 44  # issue 41's 24, issue 57's 20
    partial = dict(stages)["partial participation"]  # fixed cells: 4 arms x seeds 0-2, 100 clients, 10 a round
    assert len(partial) == 12 and {r.name for r in partial} == {"fedpa", "fedpa_adamw5e-3_lam1", "fedit", "fedsa_lora"}
    assert all({"federate.client_num": "100", "federate.sample_client_num": "10", "eval.freq": "6"}.items()
               <= dict(zip(r.opts[::2], r.opts[1::2])).items() and r.rounds == 60 for r in partial)  # fmt: skip
    edge = dict(stages)["tuning grid edge"]
    at_top = {m for m, c in selected["methods"].items() if (c["optimizer"], c["lr"]) == ("AdamW", 0.005)}
    assert {r.method for r in edge} == at_top and "fedrot_lora" not in at_top and "fedpa" not in at_top
    T = selected["T"]
    for run in edge:  # tuned exactly as the tuning stage: held-out split, seed 0, ceil(T/2) rounds; the dev set unread
        o = _opts(run)
        assert (o["train.optimizer.type"], o["train.optimizer.lr"]) == ("AdamW", "0.01")
        assert o["data.glue_holdout"] == "0.015" and o["fedpa.eval_local"] == "False"
        assert run.stage == "tune" and run.seed == 0 and run.rounds == -(-T // 2)
    before = selected_file.read_text()
    for run in edge:  # the edge wins for FedIT only
        score = 0.99 if run.method == "fedit" else 0.5
        results[run.key] = _result(run, {1: score, 2: score})
    sp.plan(results, tmp_path)
    assert selected_file.read_text() == before  # the selection is never changed by the check
    rows = {line.split(" | ")[0][2:]: line for line in edge_section(results, sp.plan(results, tmp_path), tmp_path)
            if line.startswith("| ") and not line.startswith("| method")}  # fmt: skip
    assert set(rows) == at_top
    assert rows["fedit"].endswith("| 0.9900 | higher |") and rows["flexlora"].endswith("| 0.5000 | selection holds |")


def test_each_stage_beyond_the_main_cell_has_its_last_rounds_mechanism_beside_its_accuracy(tmp_path, monkeypatch):
    from research.harness import plots
    from research.study.report import write_report

    monkeypatch.setattr(plots, "plot_all", lambda *args: [])  # the figures are test_plots.py's

    selected = {"T": 4, "methods": {m: {"method": m, "optimizer": "AdamW", "lr": 2e-3, "lam": 0.01} for m in sp.MAIN}}
    results = {}
    for run in sp.final_runs(selected, 4, seeds=(0, 1)):
        if run.method == "fedpa":
            results[run.key] = _result(run, {4: 0.88})
            results[run.key]["diagnostics"] = [
                {"round": 4, "global_update_norm": 3.0, "delta_norm_mean": 4.0, "bytes_total": 1}
            ]
    for seed, (glob, delta, ratio) in enumerate([(2.0, 8.0, 7000.0), (4.0, 8.0, 10.0), (6.0, 8.0, 20.0)]):
        run = sp.Run("ablation", "fedpa_reg_a", "fedpa", (), seed, 4)
        results[run.key] = _result(run, {4: 0.86})
        early = {"round": 2, "global_update_norm": 100.0, "delta_norm_mean": 1.0, "grad_ratio_last_mean": 1.0}
        last = {
            "round": 4,
            "global_update_norm": glob,
            "delta_norm_mean": delta,
            "grad_ratio_last_mean": ratio,
            "bytes_total": 1,
        }
        results[run.key]["diagnostics"] = [early, last]
    text = write_report(tmp_path, results, []).read_text()
    ablation = text.split("## Ablation", 1)[1].split("\n## ", 1)[0]
    table = ablation.split("The last round's diagnostics", 1)[1]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| fedpa")]
    assert [r[0] for r in rows] == ["| fedpa", "| fedpa_reg_a"]  # the reference first: the higher accuracy
    fedpa, reg_a = rows
    assert fedpa[1:6] == ["2", "0.8800", "3", "4", "0.75"]
    # last round only; coherence per seed (2/8, 4/8, 6/8) then averaged; the gradient ratio by its median over seeds
    assert reg_a[1:6] == ["3", "0.8600", "4", "8", "0.5"] and reg_a[-1] == "20 |"
    assert "The last round's diagnostics" not in text.split("## Final runs", 1)[1].split("\n## ", 1)[0]


def _fs_outputs(out: Path, accs: dict[int, float], lams: list[float]) -> None:
    """What one FS run leaves in its --work folder: result.json, the server's eval log and diagnostics file."""
    (out / "run").mkdir(parents=True)
    (out / "result.json").write_text(json.dumps({"cell": out.name[:-3], "method": "fedpa", "seed": 0, "seconds": 9.0}))
    (out / "run" / "eval_results.log").write_text(
        "".join(f"{{'Round': {r}, 'Results_weighted_avg': {{'val_acc': {a}}}}}\n" for r, a in accs.items())
    )
    record = {"round": 1, "lam": {str(i + 1): lam for i, lam in enumerate(lams)}, "bytes_up_total": 4}
    (out / "run" / "fedpa_diagnostics.jsonl").write_text(json.dumps(record) + "\n")


def test_recollect_rewrites_committed_runs_from_their_fs_outputs_and_keeps_the_runners_fields(tmp_path):
    report, work = tmp_path / "report", tmp_path / "work"
    committed = {
        "stage": "adaptive",
        "rounds_planned": 1,
        "fs_opts": ["fedpa.num_threads", "1"],
        "jobs": 2,
        "cell": "fedpa_adaptive_grad",
        "method": "fedpa",
        "seed": 0,
        "seconds": 9.0,
        "rounds": {"1": {"val_acc": 0.8}},
        "diagnostics": [{"round": 1, "bytes_total": 4}],  # compacted before λ was kept
    }
    for stage, name in (("adaptive", "fedpa_adaptive_grad_s0"), ("adaptive", "fedpa_adaptive_loss_s0")):
        (report / "runs" / stage).mkdir(parents=True, exist_ok=True)
        (report / "runs" / stage / f"{name}.json").write_text(json.dumps({**committed, "cell": name[:-3]}))
    _fs_outputs(work / "adaptive" / "fedpa_adaptive_grad_s0", {1: 0.8}, [0.5, 10.0])  # loss_s0: not on this machine
    results = pr.load_results(report)
    assert sc.recollect(results, report, work, ["hetero"]) == []  # another stage: nothing read
    assert sc.recollect(results, report, work, ["adaptive"]) == ["adaptive/fedpa_adaptive_grad_s0"]
    again = pr.load_results(report)
    grad, loss = again["adaptive/fedpa_adaptive_grad_s0"], again["adaptive/fedpa_adaptive_loss_s0"]
    assert grad["diagnostics"][0]["lam_max"] == 10.0 and grad["diagnostics"][0]["lam_mean"] == 5.25
    assert {k: grad[k] for k in pr.RUNNER_FIELDS} == {k: committed[k] for k in pr.RUNNER_FIELDS}
    assert grad["rounds"] == {1: {"val_acc": 0.8}} and results["adaptive/fedpa_adaptive_grad_s0"] == grad
    assert "lam_mean" not in loss["diagnostics"][0]  # left as committed


def test_recollect_refuses_outputs_of_another_run_than_the_committed_one(tmp_path):
    report, work = tmp_path / "report", tmp_path / "work"
    (report / "runs" / "adaptive").mkdir(parents=True)
    run = {"cell": "fedpa_adaptive_grad", "seed": 0, "seconds": 9.0, "rounds": {"1": {"val_acc": 0.8}}}
    (report / "runs" / "adaptive" / "fedpa_adaptive_grad_s0.json").write_text(json.dumps(run))
    _fs_outputs(work / "adaptive" / "fedpa_adaptive_grad_s0", {1: 0.7}, [0.5])  # a rerun with another curve
    with pytest.raises(ValueError, match="another run than the committed adaptive/fedpa_adaptive_grad_s0"):
        sc.recollect(pr.load_results(report), report, work, ["adaptive"])
    assert json.loads((report / "runs" / "adaptive" / "fedpa_adaptive_grad_s0.json").read_text()) == run


def test_the_adaptive_stage_shows_the_lambda_each_rule_chose_over_rounds(tmp_path, monkeypatch):
    from research.harness import plots
    from research.study.report import write_report

    monkeypatch.setattr(plots, "plot_all", lambda *args: [])
    results = {}
    for seed, scale in enumerate((1.0, 3.0)):
        run = sp.Run("adaptive", "fedpa_adaptive_grad", "fedpa", (), seed, 3)
        results[run.key] = _result(run, {3: 0.85})
        results[run.key]["diagnostics"] = [
            {
                "round": r,
                "lam_mean": scale * lam,
                "lam_min": scale * lam / 2,
                "lam_max": scale * lam * 2,
                "bytes_total": 1,
            }
            for r, lam in enumerate((10.0, 0.5, 0.25))
        ]
    fixed = sp.Run("adaptive", "fedpa_fixed", "fedpa", (), 0, 3)
    results[fixed.key] = _result(fixed, {3: 0.86})  # no λ recorded: no row
    text = write_report(tmp_path, results, []).read_text()
    table = text.split("## Adaptive λ", 1)[1].split("The λ_i^(t) each rule chose", 1)[1]
    rows = [line.split(" | ") for line in table.splitlines() if line.startswith("| fedpa")]
    assert len(rows) == 1 and rows[0][:2] == ["| fedpa_adaptive_grad", "2"]
    # seeds 1x and 3x: mean over seeds 20, 1, 0.5 at rounds 0, 1, 2; range over clients and seeds 0.125-1.5
    assert rows[0][2:5] == ["20 (round 0)", "1 (round 1)", "0.5 (round 2)"]
    assert rows[0][5] == "0.125 – 1.5" and rows[0][6] == f"{(10.75 / 3 + 32.25 / 3) / 2:.3g} |"


def test_a_second_call_in_the_same_work_folder_is_refused_and_a_dead_calls_lock_is_taken_over(tmp_path):
    import os
    import subprocess
    import sys

    work = tmp_path / "work"
    with subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"]) as other:
        work.mkdir()
        (work / "runner.pid").write_text(str(other.pid))
        with pytest.raises(SystemExit, match=f"another sst2_compare call \\(pid {other.pid}\\) runs in"):
            sc.claim_work(work)
        other.kill()
    sc.claim_work(work)  # its process is gone: the lock is this call's now
    assert (work / "runner.pid").read_text() == str(os.getpid())


def test_finished_fs_outputs_of_a_pending_run_are_taken_and_said_so(tmp_path, monkeypatch, capsys):
    fake_fs_runs(monkeypatch)
    run = sp.Run("hetero", "fed_plora_r2_4_16", "fed_plora", (), 0, 2)
    out = tmp_path / "work" / "hetero" / "fed_plora_r2_4_16_s0"
    out.mkdir(parents=True)
    (out / "result.json").write_text("{}")
    sc.execute([run], {}, tmp_path, tmp_path / "work", tmp_path, {"ran": 0.0, "stop_at": 0.0})
    assert f"{out} holds a finished FS run: its outputs are taken, not rerun" in capsys.readouterr().out


def runner_report(tmp_path, monkeypatch) -> Path:
    """A copy of the committed results for ``sc.main`` to run against, with the GLUE folder and the report writer
    stubbed out."""
    report = tmp_path / "report"
    shutil.copytree(sp.REPORT, report, ignore=shutil.ignore_patterns("*.png", "*.md"))
    monkeypatch.setattr(sc, "find_glue_dir", lambda data: tmp_path)
    monkeypatch.setattr(sc, "write_report", lambda *args: report / "report.md")
    return report


def test_stage_runs_only_the_named_stages_runs_and_refuses_an_unknown_stage(tmp_path, monkeypatch):
    calls = fake_fs_runs(monkeypatch)
    report = runner_report(tmp_path, monkeypatch)
    for stage in ("long", "partial"):  # both pending, whatever has been committed since: long comes first in the plan
        shutil.rmtree(report / "runs" / stage, ignore_errors=True)
    long_left = sp.long_runs(json.loads((report / "selected.json").read_text()))
    argv = ["--report", str(report), "--work", str(tmp_path / "work"), "--jobs", "2", "--stage", "partial"]
    assert sc.main([*argv, "use_gpu", "True", "device", "0"]) == 0
    partial = sp.partial_runs(json.loads((report / "selected.json").read_text()))
    assert sorted(name for name, _ in calls) == sorted(r.name for r in partial)  # every partial run, nothing else
    assert all(opts[-6:] == ["use_gpu", "True", "device", "0", "fedpa.num_threads", "1"] for _, opts in calls)
    assert not any(r.key in pr.load_results(report) for r in long_left)  # the long stage before it did not run
    with pytest.raises(SystemExit, match=r"--stage: unknown \['longer'\]; the stages are pilot tune"):
        sc.main([*argv[:-1], "longer"])


def test_every_run_of_the_plan_belongs_to_a_named_stage():
    stages = sc.plan(pr.load_results(sp.REPORT), sp.REPORT)  # the runner's: the protocol's and the dpregime stage's
    assert {r.stage for _, runs in stages for r in runs} == set(sp.STAGES)


def test_the_partial_participation_section_pairs_each_fedpa_arm_with_each_baseline_and_bins_drift_by_staleness(
    tmp_path, monkeypatch
):
    from research.study import plots
    from research.study.report import write_report

    monkeypatch.setattr(plots, "plot_protocols", lambda *args: None)  # the figures are test_plots.py's
    monkeypatch.setattr(plots, "plot_staleness", lambda *args: None)
    selected = {"T": 4, "methods": {m: {"method": m, "optimizer": "AdamW", "lr": 2e-3, "lam": 0.01} for m in sp.MAIN}}
    accs = {
        "fedpa": (0.86, 0.88),
        "fedpa_adamw5e-3_lam1": (0.87, 0.87),
        "fedit": (0.90, 0.91),
        "fedsa_lora": (0.85, 0.86),
    }
    results = {}
    for run in sp.partial_runs(selected, rounds=12):
        if run.seed > 1:
            continue
        result = _result(run, {11: accs[run.name][run.seed]})
        result["rounds"][11]["val_total"] = 872 / 97  # 97 clients with a non-empty dev shard
        if run.seed == 0:  # per-client pairs in round 6, a round mean in round 8 (a run recorded before the pairs)
            result["diagnostics"] = [{"round": 6, "stale_drift": [[1, 0.5], [4, 1.0], [30, 9.0]]}]
        else:
            result["diagnostics"] = [{"round": 8, "staleness_mean": 5.5, "drift_start_mean": 2.0},
                                     {"round": 10, "staleness_mean": 2.6, "drift_start_mean": 4.0}]  # fmt: skip
        result["fs_opts"] = ["use_gpu", "True"] if run.seed == 0 else []
        results[run.key] = result
    section = write_report(tmp_path, results, []).read_text().split("## Partial participation", 1)[1]
    assert "seeds run so far: 0, 1 of 0, 1, 2" in section
    assert (
        "GPU, torch ?: fedpa s0, fedpa_adamw5e-3_lam1 s0, fedit s0, fedsa_lora s0; CPU, torch ?: fedpa s1" in section
    )
    assert "| fedit | 0.9050 ± 0.0071 (2) | 0.9050 ± 0.0071 (2) | 97 of 100 |" in section  # sample sd of 0.90, 0.91
    # fedpa − fedit: differences -0.04, -0.03; mean -0.035, sd 0.00707, t(0.975, 1) = 12.706: ± 0.0635
    row = next(line for line in section.splitlines() if line.startswith("| fedpa − fedit |"))
    assert "-0.0350 [-0.0985, +0.0285] n=2: arm ties" in row
    assert sum(line.startswith("| fedpa") and " − " in line for line in section.splitlines()) == 4
    # [1, 3): 0.5 (seed 0's client) and the seed-1 round mean at 2.6 (4.0); [3, 6): 1.0 and the mean at 5.5 (2.0)
    row = next(line for line in section.splitlines() if line.startswith("| fedit (round means, in part) |"))
    assert row == "| fedit (round means, in part) | 2.250 (2) | 1.500 (2) | – | – | 9.000 (1) |"
    assert (
        "| arm | staleness [1, 3) | staleness [3, 6) | staleness [6, 11) | staleness [11, 21) | staleness [21, ∞) |"
        in section
    )


def test_the_split_stage_runs_both_methods_at_both_betas_on_the_two_new_splits_and_reuses_the_committed_one():
    selected = json.loads((sp.REPORT / "selected.json").read_text())
    runs = sp.splits_runs(selected, selected["T"])
    assert len(runs) == 44 and len({r.key for r in runs}) == 44
    assert {r.stage for r in runs} == {"splits"} and {r.rounds for r in runs} == {21}
    combos = []
    for run in runs:
        opts = dict(zip(run.opts[::2], run.opts[1::2]))
        split, beta = int(opts["data.glue_split_seed"]), opts.get("data.splitter_args")
        assert beta in (None, "[{'alpha': 0.1}]")
        assert opts["fedpa.num_threads"] == "1" and opts["data.glue_holdout"] == "0"  # the dev set, one thread
        chosen = selected["methods"][run.method]
        assert (opts["train.optimizer.type"], float(opts["train.optimizer.lr"])) == (chosen["optimizer"], chosen["lr"])
        combos.append((run.method, 0.5 if beta is None else 0.1, split, run.seed))
    methods, betas, splits, seeds = ("fedpa", "fedit"), (0.5, 0.1), (1, 2), (0, 1, 2)
    first = {(m, b, s, seed) for m in methods for b in betas for s in splits for seed in seeds}
    assert set(combos[:24]) == first  # issue 41's runs, as they ran
    # issue 57: beta = 0.1 only, splits 3-7, seeds 0-1, split by split so that each split's mean completes early
    assert combos[24:] == [(m, 0.1, s, seed) for s in (3, 4, 5, 6, 7) for seed in (0, 1) for m in methods]
    assert sp.split_seeds(0.1) == (12345, 1, 2, 3, 4, 5, 6, 7) and sp.split_seeds(0.5) == (12345, 1, 2)
    # the committed split's cells are the committed final and beta runs, which carry split_seed 12345
    results = pr.load_results(sp.REPORT)
    for method in ("fedpa", "fedit"):
        for beta in (0.5, 0.1):
            for seed in (0, 1, 2):
                assert results[sp.splits_key(method, beta, 12345, seed)]["split_seed"] == 12345
    assert sp.splits_key("fedpa", 0.1, 2, 1) == "splits/fedpa_beta0.1_split2_s1"
    assert all(r["split_seed"] == 12345 for r in results.values() if not r.get("stage") == "splits")


def test_a_run_file_records_its_split_seed_from_the_config_fs_saved_and_the_commit_it_ran(tmp_path):
    import subprocess

    from research.harness import compare

    for value, expected in ((None, 12345), (-1, 12345), (7, 7)):
        folder = tmp_path / str(value)
        folder.mkdir()
        data = {"type": "sst2@glue"} if value is None else {"glue_split_seed": value}
        (folder / "config.yaml").write_text(json.dumps({"data": data}))
        assert compare.split_seed(folder) == expected
    assert compare.split_seed(tmp_path / "nowhere") is None
    root = Path(compare.__file__).resolve().parents[1]
    head = subprocess.run(["git", "-C", str(root), "rev-parse", "HEAD"], capture_output=True, text=True)
    if head.returncode != 0:
        pytest.skip("fs_fedpa is not imported from a git checkout")
    assert compare.code_commit().split("+")[0] == head.stdout.strip()


def test_the_privacy_stage_tunes_on_held_out_data_at_the_full_runs_noise_then_clips_at_the_no_dp_median():
    selected = {"T": 21, "methods": {m: {"method": m, "optimizer": "AdamW", "lr": 2e-3, "lam": 0.01 if m == "fedpa"
                                         else None} for m in sp.MAIN}}  # fmt: skip
    stages = dict(spriv.privacy_runs(selected, {}, 21))
    tune = stages["privacy: sample-level tuning"]
    assert len(tune) == 4 * 6 + len(sp.LR_GRID) and "privacy: sample-level final" not in stages
    for run in tune:
        o = _opts(run)
        assert run.seed == 0 and run.rounds == 11 and o["data.glue_holdout"] != "0"  # the dev set is never read
        if "_dp_" in run.name:
            assert o["fedpa.dp_mode"] == "sample" and o["fedpa.dp_epsilon"] == "8" and o["fedpa.dp_horizon"] == "21"
            assert (o["fedpa.dp_clip"], o["train.optimizer.lr"]) in {(c, lr) for c in ("0.1", "1")
                                                                     for lr in ("0.002", "0.005", "0.01")}  # fmt: skip
        else:
            assert run.method == "fedsvd" and "fedpa.dp_mode" not in o
    # one cell's runs all in: that cell alone is selected and gets its final runs; one run missing holds a cell back
    fedit = {r.key: {"rounds": {11: {"val_acc": 0.8}}} for r in tune if r.name.startswith("tune_fedit_dp_")}
    early = {**fedit, **{r.key: {"rounds": {11: {"val_acc": 0.9}}} for r in tune if r.method == "fedsvd"}}
    early.pop(next(r.key for r in tune if r.method == "fedsvd" and "_dp_" not in r.name))
    finals = dict(spriv.privacy_runs(selected, early, 21))["privacy: sample-level final"]
    assert {r.name for r in finals} == {"fedit_dp", "fedsvd_dp"} and len(finals) == 6
    # every tuning run in: the best held-out score per cell is selected, and its final runs use the dev set
    results = {r.key: {"rounds": {11: {"val_acc": 0.8 + (0.01 if "_c1_" in r.name else 0)}}} for r in tune}
    finals = dict(spriv.privacy_runs(selected, results, 21))["privacy: sample-level final"]
    assert {r.name for r in finals} == {"fedpa_dp", "fedit_dp", "ffa_lora_dp", "fedsvd_dp", "fedsvd"}
    assert len(finals) == 15 and all(_opts(r)["data.glue_holdout"] == "0" and r.rounds == 21 for r in finals)
    assert all(_opts(r)["fedpa.dp_clip"] == "1" for r in finals if r.name.endswith("_dp"))
    # client level: the clip is the median over rounds of the no-DP run's mean contribution norm
    plain = stages["privacy: client level, no DP"]
    assert [r.method for r in plain] == list(spriv.CLIENT_DP_METHODS) and not stages["privacy: client level, DP"]
    assert all(r.seed == 1 and r.rounds == 30 and _opts(r)["federate.client_num"] == "100" for r in plain)
    done = {r.key: {"diagnostics": [{"delta_norm_mean": v, "change_norm_mean": 2 * v} for v in (1.0, 3.0, 2.0)]}
            for r in plain}  # fmt: skip
    private = dict(spriv.privacy_runs(selected, done, 21))["privacy: client level, DP"]
    clips = {r.method: _opts(r)["fedpa.dp_clip"] for r in private}
    assert clips == {"fedpa": "2", "fedit": "4", "ffa_lora": "4", "fedsa_lora": "4", "fedsvd": "4"}
    assert all(_opts(r)["fedpa.dp_mode"] == "client" for r in private)


def test_cells_runs_only_the_matching_cells_of_a_stage(tmp_path, monkeypatch):
    calls = fake_fs_runs(monkeypatch)
    report = runner_report(tmp_path, monkeypatch)
    shutil.rmtree(report / "runs" / "partial")
    argv = ["--report", str(report), "--work", str(tmp_path / "work"), "--stage", "partial", "--cell", "fedpa*"]
    assert sc.main(argv) == 0
    partial = sp.partial_runs(json.loads((report / "selected.json").read_text()))
    expected = sorted(r.name for r in partial if r.name.startswith("fedpa"))
    assert expected and len(expected) < len(partial) and sorted(name for name, _ in calls) == expected


def test_plan_counts_only_the_runs_stage_and_cell_select(tmp_path, monkeypatch, capsys):
    # --plan with --stage/--cell shows the runs that call would run, and says when a pattern matches none
    report = runner_report(tmp_path, monkeypatch)
    for old in (report / "runs" / "privacy").glob("partial30_*_dp_*"):
        old.unlink()
    assert sc.main(["--plan", "--report", str(report), "--stage", "privacy", "--cell", "partial30_*_dp"]) == 0
    lines = capsys.readouterr().out.splitlines()
    parts = [line.strip().split(":")[1].strip() for line in lines if line.startswith("  ")]
    n = len(spriv.CLIENT_DP_METHODS)
    assert parts == ["client level, DP"] and f"0/{n} runs done" in lines[0], lines
    assert "--stage/--cell select" in lines[-1]
    assert sc.main(["--plan", "--report", str(report), "--cell", "no_such_cell"]) == 0
    assert "matches --stage/--cell: nothing to run" in capsys.readouterr().out


def test_the_runner_fills_its_job_slots_from_every_decided_part_of_a_stage(tmp_path, monkeypatch):
    # the client-level DP runs whose no-DP runs are in go beside the one no-DP run still missing, not after it
    report = runner_report(tmp_path, monkeypatch)
    for old in (report / "runs" / "privacy").glob("partial30_*"):
        old.unlink()
    done = {
        "seconds": 6.0,
        "rounds": {"30": {"val_acc": 0.8}},
        "diagnostics": [{"delta_norm_mean": 1.0, "change_norm_mean": 1.0}],
    }
    for method in spriv.CLIENT_DP_METHODS[1:]:
        pr.write_run(
            report, f"privacy/partial30_{method}_s{spriv.CLIENT_DP_SEED}", {**done, "cell": f"partial30_{method}"}
        )
    batches = []

    def execute(runs, results, *args):
        batches.append(sorted(r.name for r in runs))
        results.update({r.key: done for r in runs})
        return len(runs)

    monkeypatch.setattr(sc, "execute", execute)
    argv = ["--report", str(report), "--work", str(tmp_path / "work"), "--stage", "privacy", "--jobs", "2"]
    assert sc.main([*argv, "--cell", "partial30_*"]) == 0
    first = sorted(["partial30_fedpa", *(f"partial30_{m}_dp" for m in spriv.CLIENT_DP_METHODS[1:])])
    assert batches == [first, ["partial30_fedpa_dp"]]


def test_a_run_records_the_commit_of_the_code_it_started_with(tmp_path, monkeypatch):
    """The checkout may move on while a run trains for half an hour; the run file names the commit its processes
    imported at the start, not the one checked out when it finished (every run file of issue 57's first grid named
    the later one)."""
    import subprocess
    import sys

    from research.harness import compare

    commits = iter(["at-start", "at-end"])
    monkeypatch.setattr(compare, "code_commit", lambda: next(commits))
    # host_record's probe would run through the fake Popen below, and its cached None would reach later tests
    monkeypatch.setattr(compare, "host_record", lambda: {"cpu": None, "cpus": 1, "probe_cpu_seconds": None})
    real = subprocess.Popen

    def fake_fs(cmd, **kw):  # FS's place: one round line, then exit 0
        return real([sys.executable, "-c", "print('Starting training (Round #0)')"], **kw)

    monkeypatch.setattr(compare.subprocess, "Popen", fake_fs)
    cell = compare.Cell("fedpa", "fedpa", ())
    assert compare.run_one("cfg.yaml", cell, 0, tmp_path / "run", [], "1") is not None
    assert json.loads((tmp_path / "run" / "result.json").read_text())["commit"] == "at-start"
