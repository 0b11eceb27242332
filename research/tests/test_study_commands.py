"""The study's commands do what they say (issue 44, section 2): ``./run.sh compare --plan`` installs nothing, needs
no FS and writes nothing; ``./run.sh --help`` names every flag of the study's runner and of the main job;
``sst2_compare`` refuses to plan outside a checkout; the main job refuses bad arguments in one line. No FederatedScope
needed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest

from research.study import protocol_results as pr
from research.study import sst2_compare as sc
from research.study import sst2_protocol as sp
from research.tools import sst2_demo
from tests.conftest import ROOT
from tests.unit.test_commands import _checkout_copy, _env, _script, _tree

HEAVY = ("federatedscope", "torch", "transformers", "peft", "numpy", "scipy", "matplotlib")


# ------------------------------------------------------------------------------------------------ run.sh
def test_compare_plan_through_run_sh_installs_nothing_needs_no_fs_and_writes_nothing(tmp_path):
    # Prepare: a copy of the checkout, and an interpreter without site-packages: no FS, no torch, no pip
    checkout = _checkout_copy(tmp_path / "checkout")
    bare = _script(tmp_path / "python-bare", f"#!/bin/sh\nexec '{sys.executable}' -S \"$@\"\n")
    for probe in (["-c", "import federatedscope"], ["-c", "import torch"], ["-m", "pip", "--version"]):
        assert subprocess.run([bare, *probe], capture_output=True).returncode != 0, probe
    before = _tree(checkout)

    # Execute
    proc = subprocess.run(["./run.sh", "compare", "--plan"], cwd=checkout, capture_output=True, text=True,
                          env=_env(PYTHON=str(bare), PIP_NO_INDEX="1"), timeout=120)  # fmt: skip

    # Assert: the plan, and not one byte written (nor a __pycache__ folder)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "  pilot: " in proc.stdout and "[sst2_compare] committed runs:" in proc.stdout, proc.stdout
    assert "[run.sh]" not in proc.stdout + proc.stderr
    assert _tree(checkout) == before


def test_run_sh_help_exits_0_and_lists_every_subcommand_and_flag():
    proc = subprocess.run([str(ROOT / "run.sh"), "--help"], capture_output=True, text=True, timeout=30)
    assert proc.returncode == 0 and not proc.stderr, proc.stderr
    flags = {
        option
        for parser in (sc.build_parser(), sst2_demo.build_parser())
        for action in parser._actions
        for option in action.option_strings
        if option.startswith("--") and option != "--help"
    }
    assert {"--plan", "--report-only", "--data", "--cfg"} <= flags  # the parsers are read, not an empty set
    missing = [
        word for word in (*sorted(flags), "./run.sh test", "./run.sh compare", "[main]") if word not in proc.stdout
    ]
    assert not missing, f"./run.sh --help does not name {missing}"
    wrong = subprocess.run([str(ROOT / "run.sh"), "nonsense"], capture_output=True, text=True, timeout=30)
    assert wrong.returncode == 2 and "unknown subcommand nonsense" in wrong.stderr


# ------------------------------------------------------------------------------------------------ sst2_compare
def test_plan_imports_neither_fs_nor_torch_nor_numpy(tmp_path):
    # in a copy of the checkout, where the default report folder is: a regression that writes writes there
    checkout = _checkout_copy(tmp_path / "checkout")
    code = (
        "import sys\nfrom research.study import sst2_compare\nsst2_compare.main(['--plan'])\n"
        f"print(sorted({{m.split('.')[0] for m in sys.modules}} & set({HEAVY!r})))"
    )
    proc = subprocess.run([sys.executable, "-c", code], cwd=checkout, capture_output=True, text=True, timeout=60,
                          env=_env(PYTHONDONTWRITEBYTECODE="1"))  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines()[-1] == "[]"


def test_plan_writes_no_selection_where_the_plan_would_freeze_one(tmp_path):
    # Prepare: the committed pilot, tuning and final runs; the selection before its ties were frozen into it
    report = tmp_path / "report"
    for stage in ("pilot", "tune", "final"):
        shutil.copytree(sp.REPORT / "runs" / stage, report / "runs" / stage)
    selected = json.loads((sp.REPORT / "selected.json").read_text())
    (report / "selected.json").write_text(
        json.dumps({k: v for k, v in selected.items() if k not in ("ties", "strongest")})
    )
    before = _tree(report)

    # Execute
    assert sc.main(["--plan", "--report", str(report)]) == 0

    # Assert: the plan went as far as the frozen selection lets it (its later stages), yet nothing was written
    assert _tree(report) == before
    assert sc.plan_only(pr.load_results(report), report)[-1][0] != "final"


def test_compare_outside_a_checkout_refuses_in_one_line_and_says_where_it_would_write(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    for argv in (["--plan"], ["--report-only"], ["--data", str(tmp_path)]):
        with pytest.raises(SystemExit) as refusal:
            sc.main(argv)
        message = str(refusal.value.code)
        assert "\n" not in message and str(tmp_path / sp.REPORT) in message and "--report DIR" in message, message
    assert not any(tmp_path.iterdir())
    assert sc.main(["--plan", "--report", str(tmp_path / "mine")]) == 0  # a report folder named: planned there
    assert "pilot: 0/1 runs done" in capsys.readouterr().out and not any(tmp_path.iterdir())


def test_report_only_writes_the_report_alone_and_says_in_one_line_what_is_missing(tmp_path, monkeypatch, capsys):
    # Prepare: no GLUE data, no FS run; the report writer recorded, not run (its output is test_sst2_protocol's)
    report, work = tmp_path / "report", tmp_path / "work"
    shutil.copytree(sp.REPORT / "runs" / "pilot", report / "runs" / "pilot")
    written = []
    monkeypatch.setattr(sc, "write_report", lambda folder, *args: written.append(folder) or folder / "report.md")
    monkeypatch.setattr(sc, "find_glue_dir", lambda data: pytest.fail("--report-only looked for data"))
    argv = ["--report-only", "--report", str(report), "--work", str(work)]
    real = sc.importlib.util.find_spec

    # Execute + Assert: matplotlib missing is a note, and the report is still written
    monkeypatch.setattr(sc.importlib.util, "find_spec", lambda name: None if name == "matplotlib" else real(name))
    assert sc.main(argv) == 0 and written == [report] and not work.exists()
    assert (
        "[sst2_compare] matplotlib is not importable: the report's figures are left as they are"
        in capsys.readouterr().out
    )

    # Execute + Assert: scipy missing is a refusal before anything is written
    monkeypatch.setattr(sc.importlib.util, "find_spec", lambda name: None if name == "scipy" else real(name))
    with pytest.raises(
        SystemExit, match=r"^the report's intervals need scipy, which this Python lacks .*nothing was written$"
    ):
        sc.main(argv)
    assert written == [report]


def test_plan_refuses_recollect():
    with pytest.raises(SystemExit, match="--plan writes nothing, and --recollect rewrites committed runs"):
        sc.main(["--plan", "--recollect", "final"])


def test_sst2_demo_refuses_an_odd_number_of_overrides_in_one_line_before_looking_for_data(monkeypatch):
    monkeypatch.delenv("FS_FEDPA_DATA", raising=False)
    with pytest.raises(SystemExit, match=r"^FS overrides come in KEY VALUE pairs; got 3 words: a b c$"):
        sst2_demo.main(["a", "b", "c"])
    with pytest.raises(SystemExit, match=r"^--cfg nowhere.yaml: no such FS config$"):
        sst2_demo.main(["--cfg", "nowhere.yaml"])
