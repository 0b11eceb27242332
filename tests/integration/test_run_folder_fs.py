"""A run's files stay in its own folder, and an export is the adapter of the run it names (issue 72): the shipped
tiny yaml run twice into two folders, the second at another λ and rate; then two runs onto one explicit save_to."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.integration.tiny_assets import fs_env, run_module

pytestmark = pytest.mark.integration

TINY = ROOT / "yaml_configs" / "fedpa_tiny_llm_cpu.yaml"


def _shipped(tiny_llm, cwd: Path, *opts: str):
    """The shipped tiny yaml, verbatim, from ``cwd``, on the session's tiny model and data, 2 rounds."""
    assets = ("data.root", str(tiny_llm["root"]), "model.type", f"{tiny_llm['model']}@huggingface_llm",
              "federate.total_round_num", "2")  # fmt: skip
    return run_module("federatedscope.main", ["--cfg", str(TINY), *assets, *opts], cwd, fs_env(), 300)


def _export(cwd: Path, run: Path, out: Path):
    return run_module("fs_fedpa.tools.export", [str(run), "--out", str(out)], cwd, fs_env(), 300)


def _deltas(export: Path, tiny_llm) -> dict[str, torch.Tensor]:
    """ΔW of every adapted module of the export's global adapter, loaded with PEFT onto the base."""
    from transformers import AutoModelForCausalLM

    from fs_fedpa.export import load, module_path

    model = load(AutoModelForCausalLM.from_pretrained(tiny_llm["model"]), export)
    return {module_path(n): m.get_delta_weight("default").double() for n, m in model.named_modules()
            if hasattr(m, "get_delta_weight")}  # fmt: skip


def _matches(deltas: dict[str, torch.Tensor], checkpoint: Path) -> bool:
    """Whether the export applies the checkpoint's global update B_g A_g in every module."""
    from fs_fedpa.export import module_path

    factors = torch.load(checkpoint, weights_only=True)["fedpa"]["global"]
    return all(torch.allclose(deltas[module_path(n)], B.double() @ A.double(), atol=1e-7, rtol=1e-6)
               for n, (B, A) in factors.items())  # fmt: skip


def test_two_runs_keep_their_own_files_and_each_export_is_its_own_adapter(tiny_llm, tmp_path):
    cwd = tmp_path / "work"
    cwd.mkdir()
    first = _shipped(tiny_llm, cwd, "outdir", "A")
    assert first.returncode == 0, first.stderr[-3000:]
    assert "Aggregator for method" not in first.stderr  # FS's notice for a method it does not know itself
    assert first.stderr.count("cur_mode `test` mismatch") == 1  # FS's warning at every evaluation, once
    assert "[fedpa] the run's folder: A/fedpa_tiny_llm_cpu; export its adapters: fs-fedpa export" in first.stderr
    second = _shipped(tiny_llm, cwd, "outdir", "B", "fedpa.lam", "5.0", "train.optimizer.lr", "0.05")
    assert second.returncode == 0, second.stderr[-3000:]
    run_a, run_b = cwd / "A" / "fedpa_tiny_llm_cpu", cwd / "B" / "fedpa_tiny_llm_cpu"
    assert sorted(p.name for p in cwd.iterdir()) == ["A", "B"]  # nothing beside the run folders
    for run in (run_a, run_b):
        names = {p.name for p in run.iterdir()}
        assert {"final_checkpoint.pt", "config.yaml"} <= names and "fedpa_client_1_checkpoint.pt" in names, names
    assert _export(cwd, run_a, tmp_path / "export_a").returncode == 0
    deltas = _deltas(tmp_path / "export_a", tiny_llm)
    assert _matches(deltas, run_a / "final_checkpoint.pt")
    assert not _matches(deltas, run_b / "final_checkpoint.pt")


def test_two_runs_onto_one_save_to_say_so_and_the_export_refuses_the_overwritten_one(tiny_llm, tmp_path):
    cwd = tmp_path / "work"
    cwd.mkdir()
    shared = ("federate.save_to", "shared/tiny.ckpt")
    first = _shipped(tiny_llm, cwd, "outdir", "A", *shared)
    assert first.returncode == 0 and "already holds" not in first.stderr, first.stderr[-3000:]
    second = _shipped(tiny_llm, cwd, "outdir", "B", *shared, "fedpa.lam", "5.0", "train.optimizer.lr", "0.05")
    assert second.returncode == 0, second.stderr[-3000:]
    assert "federate.save_to 'shared/tiny.ckpt' already holds final_tiny.ckpt of an earlier run" in second.stderr
    run_a, run_b = cwd / "A" / "fedpa_tiny_llm_cpu", cwd / "B" / "fedpa_tiny_llm_cpu"
    refused = _export(cwd, run_a, tmp_path / "export_a")
    lines = [line for line in refused.stderr.splitlines() if line.strip() and "WARNING" not in line]
    assert refused.returncode == 2 and len(lines) == 1 and "Traceback" not in refused.stderr, refused.stderr[-2000:]
    assert str(run_b.resolve()) in lines[0] and str(run_a.resolve()) in lines[0], lines[0]
    assert not (tmp_path / "export_a").exists()
    assert _export(cwd, run_b, tmp_path / "export_b").returncode == 0  # the later run's own files export
    assert _matches(_deltas(tmp_path / "export_b", tiny_llm), cwd / "shared" / "final_tiny.ckpt")


def test_a_misspelt_method_is_refused_naming_the_plugins(tiny_llm, tmp_path):
    proc = _shipped(tiny_llm, tmp_path, "outdir", "A", "federate.method", "fedpaa")
    assert proc.returncode != 0 and "did you mean 'fedpa'?" in proc.stderr, proc.stderr[-2000:]
    assert not list(tmp_path.glob("A/*/final_checkpoint.pt"))  # nothing trained
