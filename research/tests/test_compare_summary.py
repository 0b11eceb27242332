"""The comparison reads a run's summary.json (metrics, wall minutes, bytes per evaluation), and FS's eval_results.log
only for runs from before it; no FS run here, the run folders are written by hand."""

from __future__ import annotations

import json
import math

import pytest

from research.harness.compare import collect, summarize


def _summary(curve, wall_minutes=1.5):
    return {"format": "fs_fedpa.summary/1", "method": "fedpa", "metric": "val_acc", "wall_minutes": wall_minutes,
            "bytes": {"up": 0, "down": 0, "total": curve[-1]["bytes"] if curve else 0}, "curve": curve}  # fmt: skip


def _run_folder(root, name="fedpa_s0", summary=None, log=None, seconds=120.0):
    out = root / name
    (out / "run").mkdir(parents=True)
    (out / "result.json").write_text(json.dumps({"cell": "fedpa", "method": "fedpa", "seed": 0, "seconds": seconds}))
    if summary is not None:
        (out / "run" / "summary.json").write_text(json.dumps(summary))
    if log is not None:
        (out / "run" / "eval_results.log").write_text(log)
    return out


CURVE = [
    {"round": 0, "minutes": 0.4, "bytes": 193, "global": {"val_acc": 0.55, "val_avg_loss": 0.7},
     "own": {"val_acc": 0.52}, "eval_seconds": {"1": 0.2}},
    {"round": 2, "minutes": 1.25, "bytes": 579, "global": {"val_acc": 0.61, "refit.val_acc": 0.6},
     "own": {}, "eval_seconds": {"1": 0.3}},
]  # fmt: skip


def test_collect_reads_metrics_and_curve_from_the_summary_without_fs_log(tmp_path):
    # Prepare: a run folder with a summary.json and no eval_results.log
    out = _run_folder(tmp_path, summary=_summary(CURVE))
    # Execute
    run = collect(out)
    # Assert: global keys as they are, own keys as local.<key>; the curve's cumulative costs per evaluation
    assert run["rounds"] == {
        0: {"val_acc": 0.55, "val_avg_loss": 0.7, "local.val_acc": 0.52},
        2: {"val_acc": 0.61, "refit.val_acc": 0.6},
    }
    assert run["curve"] == [{"round": 0, "minutes": 0.4, "bytes": 193}, {"round": 2, "minutes": 1.25, "bytes": 579}]
    assert run["wall_minutes"] == 1.5 and "clients" not in run


def test_collect_reads_fs_log_for_a_run_without_summary(tmp_path):
    log = (
        "{'Role': 'Server #', 'Round': 1, 'Results_weighted_avg': {'val_acc': np.float64(0.6), "
        "'local.val_acc': 0.5}}\n"
        "{'Role': 'Client #1', 'Round': 1, 'Results_raw': {'val_acc': 0.7, 'val_total': 10}}\n"
        "{'Role': 'Server #', 'Round': 0, 'Results_weighted_avg': {'val_acc': nan}}\n"
    )
    run = collect(_run_folder(tmp_path, log=log))
    assert run["rounds"] == {0: {"val_acc": None}, 1: {"val_acc": 0.6, "local.val_acc": 0.5}}
    assert run["clients"] == {"1": {"val_acc": 0.7, "val_total": 10}}
    assert "curve" not in run and "wall_minutes" not in run


def test_a_summary_nan_reads_as_none_like_the_fs_log(tmp_path):
    curve = [{"round": 0, "minutes": 0.1, "bytes": 1, "global": {"val_avg_loss": math.nan}, "own": {}}]
    assert collect(_run_folder(tmp_path, summary=_summary(curve)))["rounds"] == {0: {"val_avg_loss": None}}


def test_a_file_that_is_no_summary_is_refused_naming_it(tmp_path):
    out = _run_folder(tmp_path, summary={"curve": []})  # no "format"
    with pytest.raises(ValueError, match=r"run/summary.json is not an fs_fedpa summary"):
        collect(out)
    bad = _run_folder(tmp_path, "b_s0", summary={"format": "fs_fedpa.summary/1", "curve": [{"round": 0}]})
    with pytest.raises(ValueError, match=r"b_s0/run/summary.json: curve entries need round, minutes, bytes"):
        collect(bad)


def test_the_table_takes_the_summarys_wall_minutes_else_the_runners_seconds(tmp_path):
    new = collect(_run_folder(tmp_path, "n_s0", summary=_summary(CURVE, wall_minutes=3.0), seconds=600))
    old = collect(_run_folder(tmp_path, "o_s0", log="{'Round': 0, 'Results_weighted_avg': {'val_acc': 0.5}}\n"))
    new["cell"], old["cell"] = "new", "old"
    rows = {r["cell"]: r for r in summarize([new, old], "val_acc", larger_is_better=True)}
    assert rows["new"]["minutes"] == (3.0, 0.0)  # not 600 s / 60
    assert rows["old"]["minutes"] == (2.0, 0.0)  # 120 s / 60
    assert rows["new"]["val_acc final"] == (0.61, 0.0) and rows["new"]["local.val_acc best"] == (0.52, 0.0)
