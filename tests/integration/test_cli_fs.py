"""``fs-fedpa run``: FS's own main with the plugin, its console shaped for a person (issue 72)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest

from tests.conftest import ROOT
from tests.integration.tiny_assets import fs_env, run_module

pytestmark = pytest.mark.integration

TINY = ROOT / "yaml_configs" / "fedpa_tiny_llm_cpu.yaml"


def _run(tiny_llm, cwd: Path, *opts: str):
    assets = ("data.root", str(tiny_llm["root"]), "model.type", f"{tiny_llm['model']}@huggingface_llm",
              "federate.total_round_num", "3")  # fmt: skip
    return run_module("fs_fedpa", ["run", "--cfg", str(TINY), *assets, *opts], cwd, fs_env(), 300)


def test_run_shows_progress_and_a_summary_and_keeps_fs_output_in_the_run_folder(tiny_llm, tmp_path):
    proc = _run(tiny_llm, tmp_path, "outdir", "runs")
    assert proc.returncode == 0, proc.stderr[-3000:]
    run = tmp_path / "runs" / "fedpa_tiny_llm_cpu"
    shown = [line for line in (proc.stdout + proc.stderr).replace("\r", "\n").splitlines() if line.strip()]
    assert "the used configs are" not in proc.stdout + proc.stderr and "hooks_in_train" not in proc.stderr
    assert len([line for line in shown if not line.lstrip().startswith("rounds:")]) < 25, shown
    assert sum("cur_mode `test` mismatch" in line for line in shown) == 1  # FS repeats it for every evaluation
    assert any(line.lstrip().startswith("rounds:") and "3/3" in line for line in shown)
    assert f"the run's folder: {Path('runs') / 'fedpa_tiny_llm_cpu'}" in proc.stdout
    assert "final, global adapter (paper protocol): test_avg_loss" in proc.stdout
    assert "final, each client's own factors:" in proc.stdout
    summary = json.loads((run / "summary.json").read_text())  # the final metrics are the summary's
    assert f"test_avg_loss {summary['final']['global']['test_avg_loss']:.4f}" in proc.stdout
    assert f"its summary (time, memory, bytes, privacy, every evaluation): {Path('runs') / 'fedpa_tiny_llm_cpu'}" in (
        proc.stdout)  # fmt: skip
    export = next(line for line in proc.stdout.splitlines() if "fs-fedpa export" in line).split(": ", 1)[1]
    assert export.startswith("fs-fedpa export runs/fedpa_tiny_llm_cpu --out")
    console = (run / "console.log").read_text()
    assert "the used configs are" in console and (run / "final_checkpoint.pt").is_file()
    exported = run_module("fs_fedpa", export.split()[1:], tmp_path, fs_env(), 300)  # the command it printed
    assert exported.returncode == 0 and (run / "export" / "global" / "adapter_config.json").is_file()


def test_run_ends_a_refused_config_in_one_line(tiny_llm, tmp_path):
    proc = _run(tiny_llm, tmp_path, "federate.method", "fedpaa")
    errors = [line for line in proc.stderr.splitlines() if "error" in line]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr + proc.stdout, proc.stderr[-2000:]
    assert errors == [errors[0]] and errors[0].startswith("fs-fedpa run: error: federate.method 'fedpaa'")
    assert "did you mean 'fedpa'?" in errors[0]


def test_the_dispatcher_names_its_commands(tmp_path):
    import subprocess

    proc = subprocess.run([sys.executable, "-m", "fs_fedpa", "nope"], capture_output=True, text=True, cwd=tmp_path,
                          env=fs_env({"PYTHONPATH": str(ROOT)}))  # fmt: skip
    commands = "run, export, dp-table, eval-generation, tiny-llm, config-doc"
    assert proc.returncode == 2 and f"unknown command 'nope'; one of {commands}" in proc.stderr
    proc = subprocess.run([sys.executable, "-m", "fs_fedpa", "dp-table", "--rounds", "0"], capture_output=True,
                          text=True, cwd=tmp_path, env=fs_env({"PYTHONPATH": str(ROOT)}))  # fmt: skip
    assert proc.returncode == 2 and proc.stderr.count("\n") == 1 and "--rounds" in proc.stderr


# A config FS cannot read: refused by the tool itself, before FS starts, in one line naming the file and the cause
# (issue 88: "FS exited with 1" or an internal error; the comparison runner's: research/tests/test_compare_cli.py)
BAD_CFGS = {
    "malformed": (b"federate:\n  method: fedpa\n total_round_num: 3\n", "not valid YAML at line 3, column 2: "),
    "a list": (b"- federate\n- fedpa\n", "FS needs a mapping of keys (e.g. 'federate: ...') at the top; got a YAML "
               "list"),
    "binary": (bytes(range(128, 256)), "not UTF-8 text (byte 0x80 at offset 0)"),
    "a control character": (b"federate:\n  method: fedpa\x00\n", "not valid YAML at line 2, column 16: character"),
    "missing": (None, "no such file"),
    "a folder": ("folder", "it is a folder, not a regular file"),
}


@pytest.mark.parametrize("case", BAD_CFGS)
def test_a_bad_cfg_ends_in_one_line_naming_the_file_and_the_cause_before_fs_starts(tmp_path, case):
    import subprocess

    content, cause = BAD_CFGS[case]
    cfg = tmp_path / "bad.yaml"
    if content == "folder":
        cfg.mkdir()
    elif content is not None:
        cfg.write_bytes(content)
    proc = subprocess.run([sys.executable, "-m", "fs_fedpa", "run", "--cfg", str(cfg)], capture_output=True,
                          text=True, cwd=tmp_path, env=fs_env({"PYTHONPATH": str(ROOT)}), timeout=300)  # fmt: skip
    lines = [line for line in proc.stderr.splitlines() if line.strip()]
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert len(lines) == 1 and lines[0].startswith(f"fs-fedpa run: error: --cfg {cfg}: "), proc.stderr[-3000:]
    assert cause in lines[0]
    assert not (tmp_path / "exp").exists() and not (tmp_path / "out").exists()  # FS never started
