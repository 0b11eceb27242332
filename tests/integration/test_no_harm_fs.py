"""With the plugin installed, FederatedScope without FedPA behaves as if it were not.

``python -S`` skips site processing, so ``fs_fedpa.pth`` never runs and FS starts without the plugin; the
same interpreter with site processing has it.
"""

from __future__ import annotations

import json
import os
import re
import site
import subprocess
import sys
from importlib.metadata import PackageNotFoundError, distribution
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.conftest import fedpa_cfg
from tests.integration.tiny_assets import fs_env, outdir_of, read_eval_results, run_fs

pytestmark = pytest.mark.integration

WITHOUT_PLUGIN = {"python_args": ["-S"], "env": {"PYTHONPATH": os.pathsep.join(site.getsitepackages())}}
# FS's own tests that run offline on CPU (toy data, no torchvision); the others need downloads
FS_OFFLINE_TESTS = (
    "test_toy_lr.py",
    "test_finetune_lr.py",
    "test_global_train_lr.py",
    "test_local_train_lr.py",
    "test_unseen_clients_lr.py",
    "test_yaml.py",
)


def _fs_source() -> Path | None:
    """A checkout of FS's llm branch, for its tests/ folder (pip installs only the package): $FS_SOURCE_DIR, the
    folder pip installed FS from (its direct_url.json), or a checkout beside this one."""
    candidates = [os.environ.get("FS_SOURCE_DIR", "")]
    try:
        url = json.loads(distribution("federatedscope").read_text("direct_url.json") or "{}").get("url", "")
        candidates.append(url.removeprefix("file://") if url.startswith("file://") else "")
    except PackageNotFoundError:
        pass
    candidates += [ROOT.parent / "fs_src" / "FederatedScope", ROOT.parent / "FederatedScope"]
    return next((Path(c) for c in candidates if c and (Path(c) / "tests" / "test_toy_lr.py").is_file()), None)


def test_plain_fedavg_is_bit_identical_with_and_without_the_plugin(tiny_llm, tmp_path):
    runs = {}
    for name, kwargs in (("with", {}), ("without", WITHOUT_PLUGIN)):
        cfg = fedpa_cfg(tiny_llm, tmp_path / name, **{"federate.method": "FedAvg", "expname": "fedavg"})
        del cfg["fedpa"]
        (tmp_path / name).mkdir()
        proc = run_fs(cfg, tmp_path / name, **kwargs)
        assert proc.returncode == 0, proc.stderr[-3000:]
        runs[name] = (outdir_of(cfg) / "eval_results.log").read_text()  # text: nan != nan as floats
    assert len(read_eval_results(outdir_of(cfg))) == 7 and runs["with"] == runs["without"]


def test_federatedscopes_own_offline_tests_still_pass(tmp_path):
    source = _fs_source()
    if source is None:
        pytest.skip(
            "FS's source checkout (its tests/ folder) was not found: set FS_SOURCE_DIR to a checkout of "
            "alibaba/FederatedScope@llm to run FS's own tests with the plugin installed"
        )
    outcomes = {}
    for name, python in (("with", [sys.executable]), ("without", [sys.executable, "-S"])):
        env = fs_env(WITHOUT_PLUGIN["env"] if name == "without" else None)
        proc = subprocess.run(
            [*python, "-m", "pytest", "-q", "-rA", "-p", "no:cacheprovider", *FS_OFFLINE_TESTS],
            cwd=source / "tests",
            env=env,
            capture_output=True,
            text=True,
            timeout=900,
        )
        outcomes[name] = {
            test: status for status, test in re.findall(r"^(PASSED|FAILED|ERROR) (\S+)", proc.stdout, re.M)
        }
    passed_without = {t for t, s in outcomes["without"].items() if s == "PASSED"}
    assert passed_without, f"no FS test passed even without the plugin: {outcomes['without']}"
    assert {t: outcomes["with"].get(t) for t in passed_without} == dict.fromkeys(passed_without, "PASSED")
