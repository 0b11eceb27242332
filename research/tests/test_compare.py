"""The comparison runner on a 2-method x 2-seed micro grid: table written, finished runs skipped."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import types

import pytest
import yaml

from tests.conftest import ROOT
from tests.integration.conftest import fedpa_cfg
from tests.integration.tiny_assets import dump_yaml, fs_env, run_module

pytestmark = pytest.mark.integration


def test_a_run_through_the_runners_command_line(tiny_llm, tmp_path):
    """The runner as a command, each FS run a subprocess of its own: the progress it reads from FS's output, FS's log
    kept, the run's wall and CPU time (its own child's) recorded, its row written."""
    cfg = dump_yaml(fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": 1}), tmp_path / "base.yaml")
    out = tmp_path / "cmp"
    cmd = [sys.executable, "-m", "research.harness.compare", "--cfg", cfg, "--methods", "fedpa", "--seeds", "0"]
    proc = subprocess.run([*cmd, "--out", str(out), "--no-plots"], cwd=ROOT, env=fs_env(), capture_output=True,
                          text=True, timeout=600)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "[1/1] fedpa, seed 0" in proc.stdout and "fedpa seed 0: round 1/1" in proc.stdout
    result = json.loads((out / "runs" / "fedpa_s0" / "result.json").read_text())
    assert result["seconds"] > 0 and result["cpu_seconds"] > 0
    assert "Starting training (Round #0)" in (out / "runs" / "fedpa_s0" / "fs.log").read_text()
    assert "| fedpa | fedpa | 1 |" in (out / "results.md").read_text()


class _ForkedFS:
    """The runner's ``subprocess.Popen`` of ``python -m federatedscope.main``, forked from the tests' zygote instead
    of a fresh interpreter (the same run; its output comes once it ends). The test above keeps the real one."""

    def __init__(self, cmd, **_):
        assert cmd[:3] == [sys.executable, "-m", "federatedscope.main"], cmd
        done = run_module("federatedscope.main", cmd[3:], ROOT, fs_env(), 600)
        self.stdout, self.returncode = io.StringIO(done.stdout + done.stderr), done.returncode

    def __enter__(self):
        return self

    def __exit__(self, *_):
        return False


def _forked_runner(monkeypatch):
    """The runner's module, its FS runs forked from the tests' zygote: fresh interpreters' imports (~10 s each) were
    most of these tests' time."""
    from research.harness import compare

    monkeypatch.setattr(compare, "subprocess", types.SimpleNamespace(**{**vars(subprocess), "Popen": _ForkedFS}))
    monkeypatch.setattr(compare, "_reap", lambda proc: None)  # no CPU time of a process that is not our child
    return compare


def test_micro_grid_writes_the_table_and_plots_and_skips_finished_runs(tiny_llm, tmp_path, monkeypatch, capsys):
    # Prepare: FedPA and a FedIT cell with an override of its own, two seeds each
    compare = _forked_runner(monkeypatch)
    cfg = dump_yaml(fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": 2}), tmp_path / "base.yaml")
    out = tmp_path / "cmp"
    argv = ["--cfg", cfg, "--methods", "fedpa", "--cell", "fedit_fast", "fedit", "train.optimizer.lr", "0.05"]
    argv += ["--seeds", "0", "1", "--out", str(out), "--metric", "val_avg_loss"]
    # Execute
    assert compare.main(argv) == 0
    first = capsys.readouterr().out
    assert compare.main(argv) == 0
    second = capsys.readouterr().out
    # Assert: progress of every run, then nothing re-run
    assert first.count("round 2/2") == 4 and "[4/4]" in first
    assert "round 1" not in second and second.count("skipped") == 4
    table = (out / "results.md").read_text()
    assert "| fedpa | fedpa | 2 |" in table and "| fedit_fast | fedit | 2 |" in table
    assert "paper protocol" in table and "train.optimizer.lr 0.05" in table
    rows = (out / "results.csv").read_text().splitlines()
    assert len(rows) == 3 and rows[0].startswith("cell,method,seeds,val_avg_loss final mean")
    # the cell's override reached FS, the others did not get it
    lrs = {c: yaml.safe_load((out / "runs" / f"{c}_s1" / "run" / "config.yaml").read_text()) for c in runs_of(out)}
    assert lrs["fedit_fast"]["train"]["optimizer"]["lr"] == 0.05 and lrs["fedpa"]["train"]["optimizer"]["lr"] != 0.05
    # diagnostics collected per run: FedPA clients keep their factors (E_init 0), FedIT clients do not
    runs = {(r["cell"], r["seed"]): r for r in json.loads((out / "runs.json").read_text())}
    for seed in (0, 1):
        fedpa, fedit = runs["fedpa", seed]["diagnostics"], runs["fedit_fast", seed]["diagnostics"]
        assert [d["round"] for d in fedpa] == [0, 1] and fedpa[1]["e_init_B"] == 0.0 and fedpa[1]["e_init_A"] == 0.0
        assert fedit[1]["e_init_A"] > 0 and fedit[1]["bytes_total"] > fedit[0]["bytes_total"] > 0
        assert fedpa[0]["spectrum_probe"] and fedpa[0]["e_agg_probe"] >= 0
    for name in ("accuracy", "mismatch", "spectrum", "bytes"):
        png = out / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n" and png.stat().st_size > 10_000, name
    # --earlier: the runs of an earlier grid join the table; a cell and seed run here replaces the earlier one
    earlier = tmp_path / "earlier.json"
    earlier.write_text((out / "runs.json").read_text())
    only = ["--cfg", cfg, "--methods", "fedpa", "--seeds", "0", "1"]
    assert compare.main([*only, "--out", str(out), "--earlier", str(earlier), "--no-plots"]) == 0
    assert capsys.readouterr().out.count("skipped") == 2
    table = (out / "results.md").read_text()
    assert "| fedit_fast | fedit | 2 |" in table and "| fedpa | fedpa | 2 |" in table
    assert f"Earlier runs from `{earlier}`" in table and table.index("| fedit_fast |") < table.index("| fedpa |")
    merged = [(r["cell"], r["seed"]) for r in json.loads((out / "runs.json").read_text())]
    assert sorted(merged) == sorted(runs) and len(merged) == 4


def runs_of(out):
    return sorted({p.name.rsplit("_s", 1)[0] for p in (out / "runs").iterdir()})


def test_bad_cells_are_refused_before_any_run(tmp_path, capsys):
    from research.harness.compare import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text("federate: {total_round_num: 1}\n")
    for argv, match in (
        (["--cell", "x", "fedpa", "fedpa.lam"], "KEY VALUE pairs"),
        (["--methods", "fedpa", "--cell", "fedpa", "fedpa", "fedpa.lam", "0"], "unique"),
        (["--cell", "a/b", "fedpa"], "folder names"),
        (["--methods", "fedpa", "fedavg"], "unknown federate.method"),
    ):
        with pytest.raises(SystemExit, match=match):
            main(["--cfg", str(cfg), "--out", str(tmp_path / "o"), *argv])
    with pytest.raises(SystemExit) as refusal:  # argparse's exit: code 2, the one line on stderr
        main(["--cfg", str(tmp_path / "missing.yaml"), "--out", str(tmp_path / "o"), "--methods", "fedpa"])
    assert refusal.value.code == 2 and "missing.yaml: cannot be read: no such file" in capsys.readouterr().err


def test_every_method_runs_through_the_runner_and_gets_its_row(tiny_llm, tmp_path, monkeypatch, capsys):
    from fs_fedpa.methods import names

    compare = _forked_runner(monkeypatch)
    cfg = dump_yaml(fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": 2}), tmp_path / "base.yaml")
    out = tmp_path / "cmp"
    assert compare.main(["--cfg", cfg, "--methods", "all", "--seeds", "0", "--out", str(out)]) == 0
    assert capsys.readouterr().out.count("round 2/2") == len(names())
    table = (out / "results.md").read_text()
    assert all(f"| {m} | {m} | 1 |" in table for m in names()), table
    runs = {r["cell"]: r for r in json.loads((out / "runs.json").read_text())}
    for exact in ("fedex_lora", "flora"):
        assert all(d["e_agg_rel"] < 1e-5 for d in runs[exact]["diagnostics"]), exact
    assert (
        runs["fedex_lora"]["diagnostics"][1]["bytes_total"] > runs["fedit"]["diagnostics"][1]["bytes_total"]
    )  # dense
