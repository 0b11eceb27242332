"""The README's quickstart, run verbatim in a copy of the checkout: tiny model, train, export, load with plain PEFT,
and the output the README shows (issue 72)."""

from __future__ import annotations

import re
import shutil
import subprocess

import pytest

from tests.conftest import ROOT
from tests.integration.tiny_assets import fs_env

pytestmark = pytest.mark.integration


def _blocks(section: str) -> tuple[str, str]:
    text = (ROOT / "README.md").read_text(encoding="utf-8")
    body = text[text.index(section) : text.index("\n## ", text.index(section) + 1)]
    return (re.search(r"```bash\n(.*?)```", body, re.S).group(1), re.search(r"```text\n(.*?)```", body, re.S).group(1))


def test_the_readmes_quickstart_runs_as_written_and_prints_what_it_shows(tmp_path):
    if shutil.which("fs-fedpa") is None:
        pytest.fail("the fs-fedpa command is not on PATH: install the package (pip install -e .), as ./run.sh test "
                    "does")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    checkout = tmp_path / "checkout"
    for name in filter(None, listed.decode().split("\0")):
        if (ROOT / name).is_file():
            (checkout / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, checkout / name)
    commands, shown = _blocks("## Quickstart")
    proc = subprocess.run(["bash", "-e", "-c", commands], cwd=checkout, capture_output=True, text=True,
                          env=fs_env(), timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    printed = proc.stdout.splitlines()
    for line in shown.strip().splitlines():
        if line.startswith("done in "):  # the seconds vary
            assert any(re.fullmatch(r"done in \d+ s" + re.escape(line[line.index(";") :]), p) for p in printed), line
        else:
            assert line in printed, f"{line!r} not printed:\n{proc.stdout}"
    assert (checkout / "exp" / "quickstart" / "adapter" / "global" / "adapter_model.safetensors").is_file()
