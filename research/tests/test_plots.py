"""The comparison figures' data: means over seeds, rounds paired by number."""

from __future__ import annotations

import warnings

import pytest

from research.harness import plots
from research.harness.plots import FIGURES, cost_curve, mean_curve, plot_all, style
from research.study.plots import plot_staleness, stale_drift


def _run(seed, acc, sent, cell="fedpa"):
    return {
        "cell": cell,
        "seed": seed,
        "rounds": {r: {"val_acc": a} for r, a in acc.items()},
        "diagnostics": [
            {
                "round": r,
                "bytes_total": b,
                "e_agg_probe": 0.1,
                "e_init_B": 0.0,
                "e_init_A": 0.0,
                "probe_module": "q",
                "global_update_norm": 0.2 + r,
                "delta_norm_mean": 0.3,
                "drift_rel_mean": 0.5,
                "grad_ratio_last_mean": 0.01 * (seed + 1),
            }
            for r, b in sent.items()
        ],
    }


def test_evaluated_rounds_are_paired_with_the_bytes_of_the_same_round():
    # a run from before summary.json: evaluation every 2nd round (1, 3), aggregation every round (0..3)
    runs = [_run(0, {1: 0.5, 3: 0.7}, {0: 2**20, 1: 2 * 2**20, 2: 3 * 2**20, 3: 4 * 2**20})]
    assert cost_curve(runs, "val_acc", "bytes") == ([2 * 2**20, 4 * 2**20], [0.5, 0.7], [0.0, 0.0])
    assert cost_curve(runs, "val_acc", "minutes") == ([], [], [])  # no wall time per evaluation recorded


def _curve_run(seed, points, cell="fedpa"):
    """A run with a summary's curve and no diagnostics: ``points`` = [(round, minutes, bytes, val_acc)]."""
    return {
        "cell": cell,
        "seed": seed,
        "rounds": {r: {"val_acc": a} for r, _, _, a in points},
        "curve": [{"round": r, "minutes": m, "bytes": b} for r, m, b, _ in points],
        "diagnostics": [],
    }


def test_the_cost_curves_are_the_summarys_minutes_and_bytes_mean_over_seeds():
    runs = [
        _curve_run(0, [(0, 0.5, 100, 0.5), (2, 1.5, 300, 0.7)]),
        _curve_run(1, [(0, 0.7, 100, 0.6), (2, 1.9, 300, 0.9), (4, 2.5, 500, 0.9)]),  # round 4: this seed only
    ]
    minutes, acc, spread = cost_curve(runs, "val_acc", "minutes")
    assert minutes == pytest.approx([0.6, 1.7]) and acc == pytest.approx([0.55, 0.8])
    assert spread == pytest.approx([0.1 / 2**0.5, 0.2 / 2**0.5])  # sample sd of two values: |a - b| / sqrt(2)
    assert cost_curve(runs, "val_acc", "bytes")[0] == [100, 300]


def test_the_minutes_figure_draws_the_summarys_minutes(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    drawn = {}
    monkeypatch.setattr(plots, "save", lambda fig, path: drawn.setdefault(path.name, fig) and path)
    runs = [_curve_run(0, [(0, 0.25, 2**20, 0.5), (3, 1.75, 3 * 2**20, 0.8)], cell=c) for c in ("a", "b")]
    plots.plot_cost(runs, "val_acc", "minutes", tmp_path / "minutes.png")
    plots.plot_cost(runs, "val_acc", "bytes", tmp_path / "bytes.png")
    minutes_lines, bytes_lines = drawn["minutes.png"].axes[0].lines, drawn["bytes.png"].axes[0].lines
    assert [list(line.get_xdata()) for line in minutes_lines] == [[0.25, 1.75]] * 2
    assert [list(line.get_ydata()) for line in minutes_lines] == [[0.5, 0.8]] * 2
    assert [list(line.get_xdata()) for line in bytes_lines] == [[1.0, 3.0]] * 2  # MiB


def test_runs_with_a_summary_get_the_minutes_figure_too(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [_curve_run(s, [(0, 0.5 + s, 100, 0.5 + s / 10), (1, 1.0 + s, 200, 0.6)], c) for s in (0, 1) for c in "ab"]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = plot_all(runs, "val_acc", tmp_path)
    assert [p.name for p in paths] == list(FIGURES)
    assert all(p.stat().st_size > 5000 for p in paths)


def test_mean_curve_keeps_the_rounds_every_seed_has():
    rounds, means, stds = mean_curve([{0: 1.0, 1: 3.0}, {1: 5.0, 2: 7.0}])
    assert rounds == [1] and means == [4.0] and stds == [pytest.approx(2**0.5)]  # sample sd of 3 and 5


def test_all_figures_are_written(tmp_path):
    pytest.importorskip("matplotlib")
    runs = [_run(s, {0: 0.5 + s / 10, 1: 0.6}, {0: 100, 1: 200}, cell=c) for s in (0, 1) for c in ("a", "b")]
    paths = plot_all(runs, "val_acc", tmp_path)
    assert [p.name for p in paths] == ["accuracy.png", "mismatch.png", "spectrum.png", "bytes.png", "mechanism.png"]
    assert all(p.stat().st_size > 5000 for p in paths)


def test_the_cells_of_a_full_comparison_get_distinct_colours_and_markers():
    styles = [style(i) for i in range(16)]  # the SST-2 protocol's final stage has 13 cells
    assert len({s["color"] for s in styles}) == 16
    assert len({(s["marker"], s["linestyle"]) for s in styles}) == 16


def test_runs_without_diagnostics_get_their_figures_without_empty_legends(tmp_path):
    # e.g. the report's tests on hand-made runs: no bytes, no mismatch, no mechanism fields; matplotlib warns on a
    # legend() over axes without labelled lines
    pytest.importorskip("matplotlib")
    runs = [{"cell": "a", "seed": 0, "rounds": {0: {"val_acc": 0.5}, 1: {"val_acc": 0.6}}, "diagnostics": []}]
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        paths = plot_all(runs, "val_acc", tmp_path)
    assert len(paths) == 5 and all(p.is_file() for p in paths)


def test_both_protocols_are_drawn_side_by_side(tmp_path):
    pytest.importorskip("matplotlib")
    from research.study.plots import plot_protocols

    runs = [_run(s, {2: 0.5 + s / 10, 5: 0.6}, {}, cell) for s in (0, 1) for cell in ("fedit", "fedpa")]
    for run in runs:
        for metrics in run["rounds"].values():
            metrics["local.val_acc"] = metrics["val_acc"] - 0.1
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        path = plot_protocols(runs, "val_acc", tmp_path / "protocols.png")
    fig = __import__("matplotlib.image", fromlist=["imread"]).imread(path)
    assert path.is_file() and fig.shape[1] > 1.5 * fig.shape[0]  # two panels side by side


def test_staleness_points_are_per_client_pairs_where_recorded_else_round_means(tmp_path):
    pairs = {
        "diagnostics": [{"round": 3, "stale_drift": [[2, 0.5], [7, 1.5]]}, {"round": 4, "stale_drift": [[1, 0.2]]}]
    }
    means = {"diagnostics": [{"round": 3, "staleness_mean": 4.5, "drift_start_mean": 1.0}, {"round": 0}]}
    assert stale_drift(pairs) == ([(2, 0.5), (7, 1.5), (1, 0.2)], True)
    assert stale_drift(means) == ([(4.5, 1.0)], False)
    assert stale_drift({"diagnostics": [{"round": 0}]}) == ([], False)  # full participation: nothing to draw
    pytest.importorskip("matplotlib")
    runs = [{"cell": "fedpa", "seed": 0, **pairs}, {"cell": "fedit", "seed": 0, **means}]
    path = plot_staleness(runs, tmp_path / "staleness.png")
    assert path.stat().st_size > 1000


def test_the_verdict_figure_draws_every_row_and_a_missing_protocol(tmp_path):
    from research.study.plots import plot_verdict

    def row(mean, verdict, holm):
        return {"mean": mean, "low": mean - 0.01, "high": mean + 0.01, "verdict": verdict, "holm": holm}

    rows = [
        {"setting": "main", "against": "fedit", "val_acc": row(-0.012, "loses", "ties"),
         "local.val_acc": row(0.005, "ties", "ties")},
        {"setting": "main", "against": "ffa_lora", "val_acc": row(0.03, "wins", "wins")},
        {"setting": "β = 0.1", "against": "fedit", "val_acc": row(0.014, "ties", "ties"),
         "local.val_acc": row(0.06, "ties", "ties")},
    ]  # fmt: skip
    path = plot_verdict(rows, tmp_path / "verdict.png")
    assert path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and path.stat().st_size > 10_000
