"""The main job's reading of FS's log lines (FS orders metric keys arbitrarily) and its data-folder checks."""

from __future__ import annotations

import pytest

from research.tools.sst2_demo import client_shards, find_glue_dir, progress

EVAL_A = (
    "(client:156) INFO: {'Role': 'Client #2', 'Round': 7, 'Results_raw': {'val_avg_loss': 0.46, "
    "'val_total': 626, 'val_acc': 0.776358, 'local.val_acc': 0.9, 'local.val_total': 626}}"
)
EVAL_B = (
    "(client:156) INFO: {'Role': 'Client #1', 'Round': 7, 'Results_raw': {'local.val_acc': 0.5, "
    "'val_acc': 1.0, 'val_loss': 0.3, 'val_total': 61}}"
)
TRAIN = (
    "(client:63) INFO: {'Role': 'Client #3', 'Round': 0, 'Results_raw': {'train_total': 800, 'train_acc': 0.87125}}"
)
SERVER = (
    "(server:616) INFO: {'Role': 'Server #', 'Round': 1, 'Results_weighted_avg': {'val_loss': np.float64(3.1), "
    "'local.val_acc': np.float64(0.69), 'val_acc': np.float64(0.7012)}, 'Results_avg': {}}"
)


def test_progress_lines():
    assert (
        progress("INFO: ----------- Starting training (Round #0) -------------", 8)
        == "round 1/8: local training on every client"
    )
    assert (
        progress("INFO: Starting a new training round (Round #3) ---", 8)
        == "round 4/8: local training on every client"
    )
    assert progress(TRAIN, 8) == "  client 3: train accuracy 0.871"
    assert (
        progress(SERVER, 8) == "  dev accuracy after round 2: 0.7012 (paper protocol), 0.6900 (clients' own factors)"
    )
    assert (
        progress("\x1b[0mINFO: [fedpa] round 2: E_agg=0.1 (rel 0.04)\x1b[0m", 8)
        == "  aggregation of round 3: E_agg=0.1 (rel 0.04)"
    )
    assert progress("some other line", 8) is None


def test_client_shards_read_the_paper_protocol_whatever_the_key_order():
    assert client_shards([TRAIN, EVAL_A, EVAL_B]) == {2: (0.776358, 626), 1: (1.0, 61)}


def test_missing_glue_folder_says_what_to_pass(tmp_path, monkeypatch):
    monkeypatch.delenv("FS_FEDPA_DATA", raising=False)
    with pytest.raises(SystemExit, match=r"(?s)No GLUE data folder given.*\./run.sh --data /path/to/glue"):
        find_glue_dir(None)
    with pytest.raises(SystemExit, match=r"(?s)SST-2/train.tsv.*not found"):
        find_glue_dir(str(tmp_path))
    (tmp_path / "glue" / "SST-2").mkdir(parents=True)
    for name in ("train.tsv", "dev.tsv"):
        (tmp_path / "glue" / "SST-2" / name).write_text("sentence\tlabel\n")
    assert find_glue_dir(str(tmp_path)) == tmp_path / "glue"  # the parent of glue/ is accepted


def test_eval_results_are_read_per_round_despite_numpy_reprs(tmp_path):
    from fs_fedpa.fs_results import weighted_avg_by_round

    log = tmp_path / "eval_results.log"
    log.write_text(
        "{'Role': 'Server #', 'Round': 1, 'Results_weighted_avg': {'val_acc': np.float64(0.8)}}\n"
        "{'Role': 'Server #', 'Round': 0, 'Results_weighted_avg': {'val_acc': np.float64(0.6), "
        "'z': np.float64(nan)}}\n"
        "{'Role': 'Server #', 'Round': 'Final', 'Results_raw': {'client_best_individual': {}}}\n"
    )
    assert weighted_avg_by_round(log) == {0: {"val_acc": 0.6, "z": None}, 1: {"val_acc": 0.8}}


def test_the_main_job_estimates_the_time_left_after_the_first_round():
    """8 rounds; round 1 starts at t = 10 s, round 2 at 70 s, round 3 at 140 s: 60 then 65 s a round so far."""
    from research.tools.sst2_demo import Clock

    clock = Clock(8)
    assert clock.line("INFO: ----------- Starting training (Round #0) -------------", 10.0) is None
    assert clock.line("INFO: something else", 30.0) is None
    assert clock.line("INFO: Starting a new training round (Round #1) ---", 70.0) == (
        "  about 7.0 min left (60 s a round so far, 7 rounds to go)"
    )
    assert clock.line("INFO: Starting a new training round (Round #2) ---", 140.0) == (
        "  about 6.5 min left (65 s a round so far, 6 rounds to go)"
    )


def test_the_start_estimate_scales_the_measured_minutes_by_the_probe_and_the_readme_quotes_the_same_rate():
    """The README's "minutes per CPU second of the host probe" is the constant the job prints from; 1.14 s (the slow
    host) gives 11 minutes at 10 per probe second."""
    from pathlib import Path

    from research.tools import sst2_demo

    rate = sst2_demo.MINUTES_PER_PROBE_SECOND
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text(encoding="utf-8")
    assert f"about {rate:g} minutes per CPU second of the host probe" in readme
    line = sst2_demo.expected_minutes(1.14)
    assert f"about {round(rate * 1.14)} minutes" in line and "probe reads 1.14 CPU s" in line
