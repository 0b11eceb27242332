"""Every tool's bad input ends in one line naming the flag, exit 2, and no traceback (issue 72); the research's tools'
in research/tests/test_tool_inputs.py."""

from __future__ import annotations

import subprocess
import sys

import pytest

from tests.conftest import ROOT

CASES = [
    ("fs_fedpa.tools.dp_table", ["--epsilon", "-1"], "--epsilon"),
    ("fs_fedpa.tools.dp_table", ["--rounds", "0"], "--rounds"),
    ("fs_fedpa.tools.dp_table", ["--rate", "nan"], "--rate"),
    ("fs_fedpa.tools.dp_table", ["--sample", "--n", "0"], "--n"),
    ("fs_fedpa.tools.dp_table", ["--sample", "--steps", "-3"], "--steps"),
    ("fs_fedpa.tools.tiny_llm", ["{file}/tiny"], "is a file"),
    ("fs_fedpa.tools.eval_generation", ["gsm8k", "--base", "x", "--no-adapter", "--data", "{file}", "--limit", "-1"],
     "--limit"),
    ("fs_fedpa.tools.eval_generation", ["gsm8k", "--base", "x", "--no-adapter", "--data", "{file}"], "--data"),
]


@pytest.mark.parametrize("module, argv, flag", CASES, ids=[f"{m.rsplit('.', 1)[1]} {' '.join(a)}" for m, a, _ in CASES])
def test_a_bad_input_is_one_line_and_exit_2(tmp_path, module, argv, flag):
    blocker = tmp_path / "a_file"
    blocker.write_text("not json {\n")
    argv = [a.replace("{file}", str(blocker)) for a in argv]
    proc = subprocess.run([sys.executable, "-m", module, *argv], capture_output=True, text=True, cwd=tmp_path,
                          env={"PYTHONPATH": str(ROOT), "PATH": "/usr/bin:/bin", "HF_HUB_OFFLINE": "1"}, timeout=120)
    lines = [line for line in proc.stderr.splitlines() if line.strip() and "Warning" not in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-2000:]
    assert len(lines) == 1 and flag in lines[0], proc.stderr[-2000:]
