"""The comparison runner on a 2-method x 2-seed micro grid: table written, finished runs skipped."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.integration.conftest import fedpa_cfg
from tests.integration.tiny_assets import dump_yaml, fs_env

pytestmark = pytest.mark.integration


def test_micro_grid_writes_the_table_and_skips_finished_runs(tiny_llm, tmp_path):
    # Prepare
    cfg = dump_yaml(fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": 2}), tmp_path / "base.yaml")
    cmd = [
        sys.executable,
        "-m",
        "fs_fedpa.compare",
        "--cfg",
        cfg,
        "--methods",
        "fedpa",
        "fedit",
        "--seeds",
        "0",
        "1",
        "--out",
        str(tmp_path / "cmp"),
        "--metric",
        "val_avg_loss",
    ]
    # Execute
    first = subprocess.run(cmd, cwd=ROOT, env=fs_env(), capture_output=True, text=True, timeout=600)
    second = subprocess.run(cmd, cwd=ROOT, env=fs_env(), capture_output=True, text=True, timeout=600)
    # Assert
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert first.stdout.count("round 2") == 4  # progress of every run
    assert second.returncode == 0 and "round 1" not in second.stdout  # nothing re-run
    table = (tmp_path / "cmp" / "results.md").read_text()
    assert "| fedpa | 2 |" in table and "| fedit | 2 |" in table and "paper protocol" in table
    rows = (tmp_path / "cmp" / "results.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("method,seeds,val_avg_loss final mean")
