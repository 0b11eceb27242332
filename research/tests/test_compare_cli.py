"""The comparison runner reads its ``--cfg`` before any run starts: a config FS cannot read ends in one line naming
the file and the cause, exit 2, as ``fs-fedpa run`` does (tests/integration/test_cli_fs.py, whose cases these are)."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.integration.test_cli_fs import BAD_CFGS
from tests.integration.tiny_assets import fs_env


@pytest.mark.parametrize("case", BAD_CFGS)
def test_a_bad_cfg_ends_in_one_line_naming_the_file_and_the_cause_before_fs_starts(tmp_path, case):
    content, cause = BAD_CFGS[case]
    cfg = tmp_path / "bad.yaml"
    if content == "folder":
        cfg.mkdir()
    elif content is not None:
        cfg.write_bytes(content)
    argv = ["-m", "research.harness.compare", "--cfg", str(cfg), "--methods", "fedpa", "--out", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, *argv], capture_output=True, text=True, cwd=tmp_path,
                          env=fs_env({"PYTHONPATH": str(ROOT)}), timeout=300)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1, proc.stderr[-3000:]
    assert lines[0].startswith(f"python -m research.harness.compare: error: --cfg {cfg}: ") and cause in lines[0]
    assert not (tmp_path / "exp").exists() and not (tmp_path / "out").exists()  # FS never started
