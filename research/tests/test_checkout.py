"""Tools that read the checkout's files (configs, scripts, research/) find it from ``--repo`` or the working
directory, and outside any checkout stop at start with one line that says how to get one."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest

from research.tools import checkout
from tests.conftest import ROOT

NEEDS = ("yaml_configs", "scripts", "research")


def test_repo_wins_then_the_working_directory(tmp_path, monkeypatch):
    other = tmp_path / "other"
    for need in NEEDS:
        (other / need).mkdir(parents=True)
    monkeypatch.chdir(other)
    assert checkout.find_checkout(None, NEEDS, "t") == other.resolve()
    assert checkout.find_checkout(str(ROOT), NEEDS, "t") == ROOT.resolve()


def test_outside_a_checkout_it_stops_with_one_line(tmp_path, monkeypatch):
    monkeypatch.setattr(checkout, "PACKAGE_CHECKOUT", tmp_path / "site-packages")  # an installed copy
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as stop:
        checkout.find_checkout(None, NEEDS, "gpu_check")
    message = str(stop.value)
    assert "\n" not in message and "--repo DIR" in message and "git clone" in message and "gpu_check" in message


def test_a_repo_that_lacks_a_folder_is_named(tmp_path):
    (tmp_path / "yaml_configs").mkdir()
    with pytest.raises(SystemExit, match=r"--repo .* lacks scripts, research"):
        checkout.find_checkout(str(tmp_path), NEEDS, "gpu_check")


@pytest.mark.parametrize("tool", ["gpu_check", "sst2_demo"])
def test_a_copy_outside_a_checkout_stops_at_start(tool, tmp_path_factory):
    """The package and the research copied out of a checkout, run from outside one: the tool exits at once with one
    line on stderr instead of failing on a missing file after minutes of work."""
    site = _installed_copy(tmp_path_factory)
    elsewhere = tmp_path_factory.mktemp("elsewhere")
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(site), "HOME": str(elsewhere)}
    args = ["--tiny", "--device", "cpu"] if tool == "gpu_check" else ["--data", str(elsewhere)]
    proc = subprocess.run([sys.executable, "-m", f"research.tools.{tool}", *args], cwd=elsewhere, env=env,
                          capture_output=True, text=True, timeout=120)  # fmt: skip
    assert proc.returncode != 0
    assert proc.stderr.strip().count("\n") == 0, proc.stderr
    assert "--repo DIR" in proc.stderr and tool in proc.stderr
    assert not list(elsewhere.rglob("*.json"))  # nothing ran


def _installed_copy(factory):
    """The package and the research in a site folder, without the checkout around them (``yaml_configs/`` and the
    rest stay there)."""
    site = factory.mktemp("site")
    for package in ("fs_fedpa", "research"):
        shutil.copytree(ROOT / package, site / package, ignore=shutil.ignore_patterns("__pycache__", "tests"))
    return site
