"""The wheel a user installs is the plugin: built by pip from the checkout's tracked files, it holds every module of
``fs_fedpa/`` and its start-up hook, and no study, harness, benchmark, ops tool or anything of ``research/``."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile

import pytest

from tests.conftest import ROOT

# the research's parts, by name: none may be a module, a folder or a file of the wheel
RESEARCH = ("research", "study", "harness", "benchmark", "scripts", "gpu_check", "gpu_prepare", "sst2_demo",
            "dp_audit", "checkout", "compare", "reproduce_cells")


def test_the_wheel_holds_the_plugin_and_nothing_of_the_research(tmp_path):
    # Prepare: the tracked files in a copy (setuptools builds in the source tree), docs/ left out (not packaged)
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the checkout's tracked files cannot be listed")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout.decode()
    source = tmp_path / "source"
    for name in (n for n in listed.split("\0") if n and not n.startswith("docs/") and (ROOT / n).is_file()):
        (source / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy2(ROOT / name, source / name)
    assert (source / "research" / "study").is_dir()  # the research is there to leave out

    # Execute: pip's own build, offline, without build isolation (setuptools of this Python)
    env = {**os.environ, "PIP_NO_INDEX": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
    built = subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "--no-index",
                            str(source), "-w", str(tmp_path / "wheel")],
                           capture_output=True, text=True, env=env, timeout=300)  # fmt: skip
    assert built.returncode == 0, built.stdout[-2000:] + built.stderr[-2000:]
    (wheel,) = (tmp_path / "wheel").glob("fs_fedpa-*.whl")
    names = zipfile.ZipFile(wheel).namelist()

    # Assert: the package's modules, all of them and only them; the hook; nothing named after the research
    modules = {n for n in names if n.endswith(".py")}
    assert modules == {str(p.relative_to(source)) for p in (source / "fs_fedpa").rglob("*.py")}
    assert {"fs_fedpa/plugin/server.py", "fs_fedpa/tools/run.py", "fs_fedpa.pth"} <= set(names)
    assert all(n.startswith(("fs_fedpa/", "fs_fedpa-", "fs_fedpa.pth")) for n in names), names
    research = sorted(n for n in names if any(part in n.lower() for part in RESEARCH))
    assert research == [], f"the wheel holds the research: {research}"
