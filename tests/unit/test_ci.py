"""``.ci/run`` tests the clone it runs in: it refuses an environment where fs_fedpa imports from elsewhere."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from tests.conftest import ROOT

CI = ROOT / ".ci" / "run"


def check_env(python: str) -> subprocess.CompletedProcess:
    return subprocess.run(["bash", str(CI), "--check-env", python], capture_output=True, text=True, timeout=120)


def test_the_environment_under_test_passes():
    """The interpreter running this suite imports this checkout (conftest insists), so CI's check accepts it."""
    done = check_env(sys.executable)
    assert done.returncode == 0, done.stderr
    assert str(ROOT / "fs_fedpa") in done.stdout


def test_a_foreign_fs_fedpa_is_refused(tmp_path):
    """The same interpreter, but a copy of the package elsewhere comes first on its path (as a developer's editable
    install of their working checkout would): refused, naming where fs_fedpa came from."""
    foreign = tmp_path / "elsewhere"
    shutil.copytree(ROOT / "fs_fedpa", foreign / "fs_fedpa", ignore=shutil.ignore_patterns("__pycache__"))
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nPYTHONPATH={foreign} exec {sys.executable} "$@"\n')
    python.chmod(0o755)
    done = check_env(str(python))
    assert done.returncode != 0
    assert "refusing" in done.stderr and str(foreign / "fs_fedpa") in done.stderr


def test_an_interpreter_without_the_plugin_is_refused(tmp_path):
    """``-S`` skips site-packages and so the start-up hook: no install of the clone at all."""
    python = tmp_path / "python"
    python.write_text(f'#!/bin/sh\nexec {sys.executable} -S "$@"\n')
    python.chmod(0o755)
    done = check_env(str(python))
    assert done.returncode != 0 and "start-up hook" in done.stderr


def test_the_research_runs_once_in_a_step_of_its_own():
    """The main suite (``./run.sh test`` with no path) collects tests/ alone, so that the research's tests, which
    ``.ci/run`` runs as a timed step of their own, do not run twice."""
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    pytest_config = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["pytest"]["ini_options"]
    assert pytest_config["testpaths"] == ["tests"]
    steps = [line.strip() for line in CI.read_text().splitlines() if "./run.sh test" in line and "PATH=" in line]
    research = [s for s in steps if "research/tests" in s]
    assert len(research) == 1 and not any("research" in s for s in steps if s not in research), steps
    text = CI.read_text()
    assert text.index("[ci] main suite:") < text.index(research[0]) < text.index('[ci] research: $((')
