"""Commands that do what they say, where FS reads the input (issue 44, section 2): the export tool refuses a config
FS does not take in one line with exit 2, as it refuses the inputs it checks without FS (tests/unit/test_commands.py).
"""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch

from tests.conftest import ROOT
from tests.integration.tiny_assets import fs_env

pytestmark = pytest.mark.integration


def test_export_refuses_a_config_with_a_key_fs_does_not_know_in_one_line_with_exit_2(tmp_path):
    # Prepare: a checkpoint file (torch.save's format) and its config with a key FS's yacs merge raises KeyError on
    torch.save({"cur_round": 1, "model": {}}, tmp_path / "model.pt")
    (tmp_path / "config.yaml").write_text("federate:\n  method: fedpa\n  no_such_key: 1\n")

    # Execute
    argv = [str(tmp_path / "model.pt"), "--cfg", str(tmp_path / "config.yaml"), "--out", str(tmp_path / "out")]
    proc = subprocess.run([sys.executable, "-m", "fs_fedpa.tools.export", *argv], cwd=ROOT, env=fs_env(),
                          capture_output=True, text=True, timeout=300)  # fmt: skip

    # Assert: one line (FS's remarks on devices included: none), exit 2, nothing written
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and not proc.stdout, proc.stderr[-3000:]
    assert lines[0] == (
        f"export: {tmp_path / 'config.yaml'} is not a config FS takes: Non-existent config key: federate.no_such_key"
    )
    assert not (tmp_path / "out").exists()
