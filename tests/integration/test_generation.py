"""GSM8K evaluation of a saved FedPA adapter: a tiny causal-LM run, then the evaluation CLI on its checkpoint."""

from __future__ import annotations

import json

import pytest
import torch

from tests.conftest import ROOT
from tests.integration.conftest import fedpa_cfg, probe
from tests.integration.tiny_assets import fs_env, run_module

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def trained(tiny_llm, tmp_path_factory):
    tmp = tmp_path_factory.mktemp("gen")
    ckpt = tmp / "fedpa.ckpt"
    run = probe(fedpa_cfg(tiny_llm, tmp, **{"federate.total_round_num": 1, "federate.save_to": str(ckpt)}), tmp)
    return {"ckpt": tmp / "final_fedpa.ckpt", "run": run, "tmp": tmp}


def test_merged_weights_are_base_plus_the_global_product(tiny_llm, trained):
    from transformers import AutoModelForCausalLM

    from fs_fedpa.tools.eval_generation import merge_global_adapter

    base = AutoModelForCausalLM.from_pretrained(tiny_llm["model"])
    model = AutoModelForCausalLM.from_pretrained(tiny_llm["model"])
    assert merge_global_adapter(model, str(trained["ckpt"])) == len(trained["run"]["final"]["global"])
    name, (B, A) = next(iter(trained["run"]["final"]["global"].items()))
    short = name.removeprefix("model.base_model.model.")
    W0 = dict(base.named_modules())[short].weight.detach().double()
    W = dict(model.named_modules())[short].weight.detach().double()
    assert torch.allclose(W, W0 + B.double() @ A.double(), atol=1e-6)
    assert not torch.equal(W, W0)


def _run_cli(task: str, model: str, ckpt, data, out, *extra: str) -> dict:
    argv = [task, "--base", model, "--ckpt", ckpt, "--data", data, "--out", out, *extra]
    proc = run_module("fs_fedpa.tools.eval_generation", argv, ROOT, fs_env(), 300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(out.read_text())


def test_gsm8k_cli_runs_on_the_checkpoint(tiny_llm, trained):
    data = trained["tmp"] / "gsm8k.jsonl"
    rows = [{"question": f"What is {i} plus {i}?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"} for i in range(3)]
    data.write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    result = _run_cli(
        "gsm8k",
        tiny_llm["model"],
        trained["ckpt"],
        data,
        trained["tmp"] / "results.json",
        "--shots-from",
        str(data),
        "--shots",
        "1",
        "--limit",
        "3",
        "--max-new-tokens",
        "4",
    )
    assert len(result["items"]) == 3 and 0.0 <= result["exact_match"] <= 1.0


def test_fedpa_runs_on_fs_llm_gsm8k_loader(tiny_llm, tmp_path):
    # Prepare: FS-LLM's gsm8k@llm reads <data.root>/gsm8k_train.jsonl (official format) and splits it itself
    root = tmp_path / "data"
    root.mkdir()
    rows = [
        {"question": f"Tom has {i} apples and buys {i}. How many?", "answer": f"{i}+{i}={2 * i}\n#### {2 * i}"}
        for i in range(40)
    ]
    (root / "gsm8k_train.jsonl").write_text("\n".join(json.dumps(r) for r in rows) + "\n")
    cfg = fedpa_cfg(
        tiny_llm, tmp_path, **{"data.type": "gsm8k@llm", "data.root": str(root), "federate.total_round_num": 2}
    )
    # Execute
    run = probe(cfg, tmp_path)
    # Assert
    assert [agg["round"] for agg in run["aggregate"]] == [0, 1]


def test_humaneval_cli_runs_on_the_checkpoint(tiny_llm, trained):
    data = ROOT.parent / "shared" / "data" / "humaneval" / "HumanEval.jsonl.gz"
    if not data.is_file():
        pytest.skip(f"no HumanEval data at {data}")
    result = _run_cli(
        "humaneval",
        tiny_llm["model"],
        trained["ckpt"],
        data,
        trained["tmp"] / "humaneval.json",
        "--limit",
        "2",
        "--max-new-tokens",
        "4",
    )
    assert len(result["items"]) == 2 and result["pass@1"] == 0.0  # a random tiny model writes no working code
