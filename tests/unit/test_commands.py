"""Commands that do what they say (issue 44, section 2): ``./run.sh`` keeps an install of the checkout; the tools
refuse bad arguments in one line before any slow load or any write. No FederatedScope needed. The study's commands
(``./run.sh compare``, the main job) are research/tests/test_study_commands.py's."""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from fs_fedpa.tools import eval_generation, tiny_llm
from tests.conftest import ROOT


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
