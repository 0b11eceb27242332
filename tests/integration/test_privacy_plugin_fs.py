"""Issue 73: a new DP mechanism plugs in by touching only ``fs_fedpa/privacy/`` (its registry and interface): the toy
Laplace mechanism of tests/integration/laplace_toy.py, registered from outside the package, runs through stock FS,
noises what leaves each client, filters its statistics and writes its own ledger."""

from __future__ import annotations

import json

import pytest

from tests.conftest import ROOT
from tests.integration.conftest import fedpa_cfg
from tests.integration.tiny_assets import dump_yaml, fs_env, outdir_of, run_module

pytestmark = pytest.mark.integration


def _run(cfg: dict, tmp_path, module: str):
    path = dump_yaml(cfg, tmp_path / "cfg.yaml")
    proc = run_module(module, ["--cfg", path], ROOT, fs_env(), 300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    return outdir_of(cfg)


def _records(out) -> list[dict]:
    return [json.loads(line) for line in (out / "fedpa_diagnostics.jsonl").read_text().splitlines()]


def test_a_toy_laplace_mechanism_plugs_in_through_the_privacy_package_alone(tiny_llm, tmp_path):
    common = {"federate.client_num": 2, "federate.total_round_num": 2, "fedpa.records.diagnostics": "full",
              "fedpa.dp.seed": -1}  # fmt: skip
    toy = fedpa_cfg(tiny_llm, tmp_path / "toy", expname="toy", **common, **{
        "fedpa.dp.mode": "laplace", "fedpa.dp.clip": 1e-3, "fedpa.dp.epsilon": 0.5})  # fmt: skip
    out = _run(toy, tmp_path / "toy", "tests.integration.laplace_toy")
    ledger = [json.loads(line) for line in (out / "fedpa_privacy.jsonl").read_text().splitlines()]
    assert [(line["round"], line["dp_mode"], line["dp_epsilon"]) for line in ledger] == [(0, "laplace", 0.5),
                                                                                        (1, "laplace", 1.0)]
    assert "[toy] Laplace on the client update: epsilon 1" in (out / "exp_print.log").read_text()
    # what left each client: its statistics filtered by the policy (none but state_lost), sample count 1, and factors
    # clipped to L1 norm 1e-3 plus Laplace noise of scale 2C/eps = 4e-3: a global adapter 100x smaller than the
    # trained one, and a sum of products far from rank R_g (noise is full rank); the run without the mechanism sends
    # what it trained
    plain = _run(fedpa_cfg(tiny_llm, tmp_path / "plain", expname="plain", **common), tmp_path / "plain",
                 "federatedscope.main")  # fmt: skip
    for toy_round, plain_round in zip(_records(out), _records(plain), strict=True):
        assert toy_round["delta_norm"] == {} and set(plain_round["delta_norm"]) == {"1", "2"}
        assert toy_round["weights"] == [1.0, 1.0] and plain_round["weights"] != [1.0, 1.0]
        assert toy_round["global_norm"] < plain_round["global_norm"] / 10
        assert toy_round["e_agg_rel"] > 10 * plain_round["e_agg_rel"]
