"""Commands that do what they say (issue 44, section 2): ``./run.sh compare --plan`` installs nothing, needs no FS
and writes nothing; ``./run.sh`` keeps an install of the checkout; ``sst2_compare`` refuses to plan outside a
checkout; the tools refuse bad arguments in one line before any slow load or any write. No FederatedScope needed."""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fs_fedpa.study import protocol_results as pr
from fs_fedpa.study import sst2_protocol as sp
from fs_fedpa.tools import eval_generation, sst2_demo, tiny_llm
from fs_fedpa.study import sst2_compare as sc
from tests.conftest import ROOT

HEAVY = ("federatedscope", "torch", "transformers", "peft", "numpy", "scipy", "matplotlib")


def _tree(root: Path) -> dict[str, str]:
    """Every file under ``root`` (relative path -> sha256), so that a file written, changed or added shows."""
    return {
        str(p.relative_to(root)): hashlib.sha256(p.read_bytes()).hexdigest() for p in root.rglob("*") if p.is_file()
    }


def _checkout_copy(dest: Path) -> Path:
    """The tracked files of this checkout as they are in the work tree (modes kept: run.sh stays executable)."""
    if shutil.which("git") is None:
        pytest.skip("git is not installed: the checkout's tracked files cannot be listed")
    listed = subprocess.run(["git", "ls-files", "-z"], cwd=ROOT, capture_output=True, check=True).stdout
    for name in listed.decode().split("\0"):
        if name and (ROOT / name).is_file():  # a tracked file deleted in the work tree is not copied
            (dest / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / name, dest / name)
    return dest


def _script(path: Path, text: str) -> Path:
    path.write_text(text)
    path.chmod(0o755)
    return path


def _env(**extra: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONDONTWRITEBYTECODE")}
    return {**env, **extra}


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


def _install_functions(tmp_path: Path, checkout: Path) -> tuple[Path, Path]:
    """A shell script that runs run.sh's install_package on its argument in ``checkout``, under a python whose
    ``-m pip`` is refused and logged; and that log."""
    log = tmp_path / "pip.log"
    python = _script(tmp_path / "python-nopip", f'#!/bin/sh\nif [ "$1" = -m ] && [ "$2" = pip ]; then\n'
                     f'  echo "$*" >> {log}\n  exit 1\nfi\nexec \'{sys.executable}\' "$@"\n')  # fmt: skip
    functions = subprocess.run(["sed", "-n", "/^package_ready() {/,/^}/p;/^install_package() {/,/^}/p",
                                str(ROOT / "run.sh")], capture_output=True, text=True, check=True).stdout  # fmt: skip
    assert functions.count("() {") == 2, functions
    script = _script(
        tmp_path / "install.sh", f'set -eu\ncd {checkout}\nPY={python}\n{functions}\ninstall_package "$1"\n'
    )
    return script, log


def test_run_sh_keeps_an_install_of_this_checkout_and_installs_over_another(tmp_path):
    # Prepare: the tests' own fs_fedpa is this checkout, installed editable (tests/conftest.py refuses anything else)
    copy = _checkout_copy(tmp_path / "checkout")
    script, log = _install_functions(tmp_path, ROOT)
    (tmp_path / "copy").mkdir()
    copied_script, copied_log = _install_functions(tmp_path / "copy", copy)

    # Execute + Assert: nothing missing for this checkout: no pip
    proc = subprocess.run(["bash", str(script), "test"], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0 and "installing" not in proc.stdout, proc.stdout + proc.stderr
    assert not log.exists()

    # Execute + Assert: an identical copy elsewhere is not installed: its own files are installed editable (before,
    # a copy with the same bytes was kept, and the tests' subprocesses then ran the other checkout's files)
    for extra in ("test", "demo"):
        proc = subprocess.run(["bash", str(copied_script), extra], capture_output=True, text=True, timeout=60)
        assert proc.returncode != 0 and f'pip install -e ".[{extra}]"' in proc.stdout, proc.stdout
        assert f"install --quiet --disable-pip-version-check -e .[{extra}]" in copied_log.read_text()


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
        "import sys\nfrom fs_fedpa.study import sst2_compare\nsst2_compare.main(['--plan'])\n"
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


# ------------------------------------------------------------------------------------------------ export
def _export(tmp_path: Path, *argv: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "fs_fedpa.tools.export", *argv, "--out", str(tmp_path / "out")],
                          cwd=tmp_path, capture_output=True, text=True, timeout=120)  # fmt: skip


@pytest.mark.parametrize(
    "case, words",
    [
        ("non-checkpoint file with --cfg", ["notes.pt is not a checkpoint (torch.save's zip archive)"]),
        ("missing --cfg file", ["missing.yaml: no such config file (--cfg)"]),
        ("malformed --cfg", ["bad.yaml is not a readable config: malformed YAML at line 4, column 1"]),
        (
            "malformed config.yaml of a run folder",
            ["config.yaml is not a readable config: malformed YAML at line 2, column 1"],
        ),
        ("config.yaml that is not a mapping", ["config.yaml is not a config: FS's configs are YAML mappings"]),
    ],
)
def test_export_refuses_bad_inputs_in_one_line_with_exit_2_before_loading_fs(tmp_path, case, words):
    # Prepare
    (tmp_path / "notes.pt").write_text("not a checkpoint\n")
    (tmp_path / "good.yaml").write_text("federate:\n  method: fedpa\n")
    (tmp_path / "bad.yaml").write_text("federate:\n  method: fedpa\n  client_num: [3,\n")
    (tmp_path / "run").mkdir()
    if case.startswith("malformed config.yaml"):
        (tmp_path / "run" / "config.yaml").write_text("federate: {method: [fedpa\n")
    elif case.startswith("config.yaml that"):
        (tmp_path / "run" / "config.yaml").write_text("- federate\n- method\n")
    argv = {
        "non-checkpoint file with --cfg": ["notes.pt", "--cfg", "good.yaml"],
        "missing --cfg file": ["notes.pt", "--cfg", "missing.yaml"],
        "malformed --cfg": ["notes.pt", "--cfg", "bad.yaml"],
    }.get(case, ["run"])

    # Execute
    proc = _export(tmp_path, *argv)

    # Assert: one line on stderr, exit 2, nothing written
    lines = proc.stderr.splitlines()
    assert proc.returncode == 2 and len(lines) == 1 and not proc.stdout, proc.stderr[-3000:]
    assert lines[0].startswith("export: ") and all(w in lines[0] for w in words), lines[0]
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------------------------ the other tools
def test_eval_generation_checks_ckpt_and_data_before_loading_the_base_model(tmp_path, capsys):
    import torch

    # Prepare: a base model that does not exist, so that loading it first would fail otherwise
    data, other = tmp_path / "test.jsonl", tmp_path / "other.pt"
    data.write_text("")
    torch.save({"model": {"w": torch.zeros(1)}}, other)
    (tmp_path / "notes.pt").write_text("not a checkpoint\n")
    base = ["gsm8k", "--base", str(tmp_path / "no_model"), "--out", str(tmp_path / "out.json")]
    cases = {
        "--ckpt": ([*base, "--ckpt", str(tmp_path / "missing.pt"), "--data", str(data)], "missing.pt: no such file"),
        "--data": ([*base, "--ckpt", str(other), "--data", str(tmp_path / "none.jsonl")], "none.jsonl: no such file"),
        "--shots-from": ([*base, "--no-adapter", "--data", str(data), "--shots-from", "nowhere"], "nowhere: no such"),
        "not a checkpoint": ([*base, "--ckpt", str(tmp_path / "notes.pt"), "--data", str(data)], "not a checkpoint"),
        "no fedpa entry": ([*base, "--ckpt", str(other), "--data", str(data)], "is not a FedPA checkpoint"),
    }
    for name, (argv, words) in cases.items():
        # Execute
        with pytest.raises(SystemExit) as refusal:
            eval_generation.main(argv)

        # Assert: argparse's refusal (exit 2), naming what is wrong; no output file
        err = capsys.readouterr().err
        assert refusal.value.code == 2 and words in err.splitlines()[-1], (name, err)
    assert not (tmp_path / "out.json").exists()


def test_sst2_demo_refuses_an_odd_number_of_overrides_in_one_line_before_looking_for_data(monkeypatch):
    monkeypatch.delenv("FS_FEDPA_DATA", raising=False)
    with pytest.raises(SystemExit, match=r"^FS overrides come in KEY VALUE pairs; got 3 words: a b c$"):
        sst2_demo.main(["a", "b", "c"])
    with pytest.raises(SystemExit, match=r"^--cfg nowhere.yaml: no such FS config$"):
        sst2_demo.main(["--cfg", "nowhere.yaml"])


@pytest.mark.parametrize(
    "extra, words",
    [(["--categories", "9"], "argument --categories: 9 must be <= 8"),
     (["--samples", "0"], "argument --samples: 0 must be >= 1")],
)
def test_tiny_llm_checks_its_arguments_before_creating_its_folder(tmp_path, capsys, extra, words):
    out = tmp_path / "tiny"
    with pytest.raises(SystemExit) as refusal:
        tiny_llm.main([str(out), *extra])
    err = capsys.readouterr().err
    assert refusal.value.code == 2 and words in err and len(err.strip().splitlines()) == 1, err
    assert not out.exists()
