"""``python -m research.tools.gpu_check --tiny --device cpu``: every step of the GPU-host check runs on the CPU at tiny
sizes, so the command cannot rot between GPU loans; and the distributed GLUE route it found broken stays fixed."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from tests.conftest import ROOT
from tests.integration.tiny_assets import dump_yaml, fs_env, fs_glue_yaml

pytestmark = pytest.mark.integration


def test_gpu_check_tiny_on_the_cpu(tmp_path):
    out = tmp_path / "check.json"
    cmd = [sys.executable, "-m", "research.tools.gpu_check", "--tiny", "--device", "cpu", "--out", str(out)]
    proc = subprocess.run(cmd, cwd=ROOT, env=fs_env(), capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-3000:]
    record = json.loads(out.read_text())
    steps = record["steps"]
    assert list(steps) == ["env", "standalone", "cpu_match", "distributed", "reconstruct", "adapter", "penalty",
                           "clients", "dp_sgd", "paper_shapes"]  # fmt: skip
    assert all(s["status"] == "ok" for s in steps.values()), {n: s["summary"] for n, s in steps.items()}
    runs = steps["standalone"]
    assert {n for n in runs if n.endswith("_fp32")} == {"fedpa_fp32", "fedit_fp32"}
    assert all(runs[n]["ok"] and runs[n]["last_round"] == 1 for n in ("fedpa_fp32", "fedit_fp32"))  # 2 rounds
    assert "skipped" in runs["fp16"]  # the CPU refuses half precision, and the record says so
    assert steps["cpu_match"]["relative_difference"] <= steps["cpu_match"]["tolerance"]
    assert steps["distributed"]["last_round"] == 1 and steps["distributed"]["auth"]
    assert set(steps["adapter"]) >= {"float32", "float16"}
    assert "ratio taps / plain" in steps["dp_sgd"]["summary"] and "ratio loop / plain" in steps["dp_sgd"]["summary"]
    shapes = steps["paper_shapes"]["results"]["shapes"]
    assert set(shapes) == {"roberta-large", "llama-3-8b"}
    assert all({"modules", "term_ops_per_step", "term_ms", "step_ms", "reconstruct_ms", "averaging_ms", "device"}
               <= set(v) for v in shapes.values())  # fmt: skip
    # the printed table names every step, as the JSON does
    table = proc.stdout[proc.stdout.rindex("\nstep ") :]  # the header row of the closing table
    assert all(name in table for name in steps)


def test_only_reruns_one_step(tmp_path):
    out = tmp_path / "check.json"
    cmd = [sys.executable, "-m", "research.tools.gpu_check", "--tiny", "--device", "cpu", "--only", "reconstruct",
           "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=ROOT, env=fs_env(), capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert list(json.loads(out.read_text())["steps"]) == ["env", "reconstruct"]


def test_repo_names_the_checkout_from_anywhere(tmp_path):
    """Run from another folder, ``--repo`` points the steps at the checkout's benchmarks (research/ is not installed:
    the checkout is on the path, as it is for any research tool run from elsewhere)."""
    out = tmp_path / "check.json"
    cmd = [sys.executable, "-m", "research.tools.gpu_check", "--tiny", "--device", "cpu", "--only", "reconstruct",
           "--repo", str(ROOT), "--out", str(out)]  # fmt: skip
    proc = subprocess.run(cmd, cwd=tmp_path, env=fs_env({"PYTHONPATH": str(ROOT)}), capture_output=True, text=True,
                          timeout=300)  # fmt: skip
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert json.loads(out.read_text())["steps"]["reconstruct"]["status"] == "ok"


def test_a_distributed_glue_party_keeps_its_own_shard(tiny_glue, tmp_path):
    """FS hands a registered loader's data back as it is, so ``<task>@glue`` must pick the party's shard itself:
    each client of a distributed run trains on the same shard as that client in standalone mode (before, every
    party got the whole dict and the clients stopped with 'No train_data')."""
    code = (
        "import sys, json\n"
        "from federatedscope.core.configs.config import global_cfg\n"
        "from federatedscope.core.auxiliaries.data_builder import get_data\n"
        "cfg = global_cfg.clone(); cfg.merge_from_file(sys.argv[1]); cfg.merge_from_list(sys.argv[2:])\n"
        "data, _ = get_data(config=cfg.clone(), client_cfgs=None)\n"
        "shard = data if cfg.federate.mode == 'distributed' else data[2]\n"
        "print('SHARD ' + json.dumps({k: [int(x[1]) for x in shard[k].dataset] if hasattr(shard[k], 'dataset') else"
        " [int(x[1]) for x in shard[k]] for k in shard}))\n"
    )
    cfg = dump_yaml(fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"]), tmp_path / "cfg.yaml")
    shards = {}
    distributed = ["distribute.use", "True", "distribute.data_idx", "2", "federate.share_local_model", "False"]
    for mode, extra in (("standalone", []), ("distributed", distributed)):
        proc = subprocess.run([sys.executable, "-c", code, cfg, "federate.mode", mode, *extra], cwd=ROOT,
                              env=fs_env(), capture_output=True, text=True, timeout=300)  # fmt: skip
        assert proc.returncode == 0, proc.stderr[-3000:]
        shards[mode] = json.loads(next(x for x in proc.stdout.splitlines() if x.startswith("SHARD "))[6:])
    assert set(shards["distributed"]) >= {"train", "val"}
    assert shards["distributed"] == shards["standalone"]
    assert len(shards["distributed"]["train"]) > 0
