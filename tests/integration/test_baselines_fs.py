"""Baselines selected by federate.method in stock FS, each with its defining property (issue: baselines)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.conftest import fedpa_cfg, probe

pytestmark = pytest.mark.integration


def _records(run):
    with open(f"{run['final']['outdir']}/fedpa_diagnostics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_fedit_global_factors_are_the_weighted_means_of_the_uploads(tiny_llm, tmp_path):
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "fedit"}), tmp_path)
    for agg in run["aggregate"]:
        total = sum(agg["weights"])
        for name, (B_g, A_g) in agg["global"].items():
            B = sum(w / total * u[name][0] for w, u in zip(agg["weights"], agg["uploads"]))
            A = sum(w / total * u[name][1] for w, u in zip(agg["weights"], agg["uploads"]))
            torch.testing.assert_close(B_g, B)
            torch.testing.assert_close(A_g, A)
    # FedIT's product of means is not the mean of products: a positive aggregation error
    assert all(r["e_agg"] > 0 for r in _records(run))


def test_flexlora_restarts_clients_from_the_global_factors(tiny_llm, tmp_path):
    flex = probe(fedpa_cfg(tiny_llm, tmp_path / "flex", **{"federate.method": "flexlora"}), tmp_path / "flex")
    fedpa = probe(fedpa_cfg(tiny_llm, tmp_path / "fedpa"), tmp_path / "fedpa")
    # E_init: FlexLoRA replaces the local factors by the re-factorised global ones, FedPA keeps them
    flex_init = [v for r in _records(flex)[1:] for v in r["e_init_B"].values()]
    fedpa_init = [v for r in _records(fedpa)[1:] for v in r["e_init_B"].values()]
    assert flex_init and all(v > 0 for v in flex_init)
    assert fedpa_init and all(v == 0 for v in fedpa_init)
    # and each FlexLoRA client starts round t+1 from the truncated global of round t
    globals_ = {agg["round"]: agg["global"] for agg in flex["aggregate"]}
    for entry in flex["enter"]:
        if entry["round"] == 0:
            continue
        for name, (B, A) in entry["start"].items():
            B_g, A_g = globals_[entry["round"] - 1][name]
            scale = 8 / B.shape[1]  # PEFT alpha / r: the client stores raw factors
            torch.testing.assert_close(scale * B @ A, B_g @ A_g)  # same product, rank r_i = R_g here
    # no alignment term is added
    assert all(gap == 0.0 for gap in flex["loss_gap"])
