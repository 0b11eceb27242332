"""The run's summary (fs_fedpa.run_summary.RunReport): its keys, final and best evaluation picked as an independent
scan of the curve picks them, the tracker's scalars, the file written whole, and its part of a resume point."""

from __future__ import annotations

import json

import pytest

from fs_fedpa.run_summary import FORMAT, RunReport, protocols, read_summary

HEAD = {"method": "fedpa", "rounds": 3, "metric": "val_acc",
        "rank_plan": {"client_ranks": [2, 4], "reference_ranks": [4, 4], "R_g": 4}}  # fmt: skip


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Recorder:
    kind = "tensorboard"

    def __init__(self):
        self.logged: list[tuple[int, dict]] = []

    def log(self, step, scalars):
        self.logged.append((step, scalars))

    def open_command(self):
        return "tensorboard --logdir x"

    def close(self):
        pass


def _report(tmp_path, tracker=None, clock=None):
    return RunReport(str(tmp_path), dict(HEAD), tracker, clock or Clock())


def _summary(report):
    return report.summary(rounds_done=3, bytes_up=10, bytes_down=20, privacy=None, export=None, commit="abc")


def test_the_protocols_split_the_clients_own_factors_off():
    glob, own = protocols({"val_acc": 0.5, "local.val_acc": 0.4, "refit.val_acc": 0.6, "val_total": 8, "x": "y"})
    assert glob == {"val_acc": 0.5, "refit.val_acc": 0.6, "val_total": 8.0} and own == {"val_acc": 0.4}


@pytest.mark.parametrize(("metric", "scores", "best"), [("val_acc", [0.5, 0.7, 0.6], 1),
                                                        ("val_avg_loss", [0.9, 0.4, 0.4], 1)])  # fmt: skip
def test_final_is_the_last_evaluation_and_best_the_top_of_the_metric(tmp_path, metric, scores, best):
    report, clock = _report(tmp_path), Clock()
    report.head["metric"], report.clock = metric, clock
    for rnd, score in enumerate(scores):
        clock.now += 60
        report.eval_seconds(rnd, 1, 0.25)
        report.evaluated(rnd, {metric: score, f"local.{metric}": score / 2}, {1: {metric: score}}, 100 * (rnd + 1))
    summary = _summary(report)
    assert summary["format"] == FORMAT and summary["final"]["round"] == 2
    assert summary["final"]["global"] == {metric: scores[-1]} and summary["final"]["own"] == {metric: scores[-1] / 2}
    assert summary["best"]["round"] == best  # the earliest of equal scores
    curve = summary["curve"]
    assert [e["minutes"] for e in curve] == [1.0, 2.0, 3.0] and [e["bytes"] for e in curve] == [100, 200, 300]
    assert all(e["eval_seconds"] == {"1": 0.25} for e in curve)
    assert summary["bytes"] == {"up": 10, "down": 20, "total": 30} and summary["wall_minutes"] == 3.0


def test_an_evaluation_asked_again_replaces_the_first(tmp_path):
    report = _report(tmp_path)
    report.evaluated(1, {"val_acc": 0.1}, {}, 5)
    report.evaluated(0, {"val_acc": 0.2}, {}, 3)
    report.evaluated(1, {"val_acc": 0.3}, {}, 5)
    assert [(e["round"], e["global"]["val_acc"]) for e in report.curve] == [(0, 0.2), (1, 0.3)]


def test_the_tracker_gets_the_rounds_systems_diagnostics_metrics_and_epsilons(tmp_path):
    tracker = Recorder()
    report = _report(tmp_path, tracker)
    record = {"round": 2, "e_agg": 0.5, "train_seconds": {"1": 1.0, "2": 3.0}, "peak_memory": {"1": 2**21},
              "server_peak_memory": 2**20, "aggregate_seconds": 0.1, "wall_seconds": 9.0, "memory_kind": "rss",
              "bytes_up": {}, "bytes_down": {}}  # fmt: skip
    report.round_done(record, {"epsilon_max": 3.0, "epsilon": {"1": 3.0, "2": None}})
    report.evaluated(2, {"val_acc": 0.5, "local.val_acc": 0.4}, {1: {"val_acc": 0.45}}, 10)
    (step, first), (step2, second) = tracker.logged
    assert step == step2 == 2
    assert first["systems/train_seconds_mean"] == 2.0 and first["systems/peak_memory_mib"] == 2.0
    assert first["diagnostics/e_agg"] == 0.5 and first["client/2/train_seconds"] == 3.0
    assert first["privacy/epsilon_max"] == 3.0 and first["client/1/epsilon"] == 3.0
    assert second == {"global/val_acc": 0.5, "own/val_acc": 0.4, "client/1/val_acc": 0.45}
    assert report.peak_memory == {"bytes": 2**21, "kind": "rss"}
    assert _summary(report)["tracker"] == {"kind": "tensorboard", "open": "tensorboard --logdir x"}


def test_the_file_is_written_whole_and_read_back_and_a_foreign_one_is_refused(tmp_path):
    report = _report(tmp_path)
    report.evaluated(0, {"val_acc": float("nan")}, {}, 0)
    path = report.write(_summary(report))
    assert read_summary(tmp_path) == json.loads(open(path).read())  # NaN dropped: standard JSON
    assert not list(tmp_path.glob("*.tmp"))
    (tmp_path / "summary.json").write_text('{"format": "other"}')
    with pytest.raises(ValueError, match="summary.json is not an fs_fedpa summary"):
        read_summary(tmp_path)
    assert read_summary(tmp_path / "nowhere") is None


def test_a_resumed_report_continues_the_curve_and_the_wall_time(tmp_path):
    clock = Clock()
    killed = _report(tmp_path / "a", clock=clock)
    killed.evaluated(0, {"val_acc": 0.5}, {}, 7)
    clock.now += 120
    state = json.loads(json.dumps(killed.state_dict()))  # plain data, as a resume point holds it
    resumed = _report(tmp_path / "b", clock=Clock())
    resumed.check_state(state, "p.pt", 1)
    resumed.load_state_dict(state, "p.pt")
    resumed.clock.now += 60
    assert resumed.curve == killed.curve and resumed.wall_seconds() == pytest.approx(180)


@pytest.mark.parametrize(("field", "value"), [("curve", [{"round": "0"}]), ("curve", {}), ("seconds", -1),
                                              ("peak_memory", [])])  # fmt: skip
def test_a_malformed_part_is_refused_naming_the_field(tmp_path, field, value):
    state = {**_report(tmp_path).state_dict(), field: value}
    with pytest.raises(ValueError, match=rf"'p\.pt'.*run_report\.{field}") as caught:
        _report(tmp_path).check_state(state, "p.pt", 1)
    assert "\n" not in str(caught.value)
