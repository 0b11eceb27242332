"""Every cell of the SST-2 protocol's later stages (β, heterogeneous ranks, ablation, adaptive λ, the head asymmetry,
the long horizon) goes through stock FS for one round with exactly the overrides the runner passes, on tiny GLUE data
and a tiny BERT: a cell that would fail hours into the grid fails here. Opt in with --run-slow (about 15 s a cell,
30 cells)."""

from __future__ import annotations

import ast
import json

import pytest
import yaml

from research.harness import compare
from research.study import sst2_protocol as sp
from tests.conftest import ROOT
from tests.integration.tiny_assets import dump_yaml, fs_env, fs_glue_yaml

pytestmark = [pytest.mark.integration, pytest.mark.slow]

STRONGEST = ["fedit", "flexlora", "fedrot_lora"]


def _selected() -> dict:
    """The committed selection (what the grid runs), or a stand-in before the tuning stage has written one."""
    path = ROOT / sp.REPORT / "selected.json"
    if path.is_file():
        return json.loads(path.read_text())
    choice = {"optimizer": "AdamW", "lr": 2e-3}
    return {"methods": {m: {"method": m, **choice, "lam": 0.1 if m == "fedpa" else None} for m in sp.MAIN}}


LATER = (*sp.extra_runs(_selected(), 1, STRONGEST), *sp.head_runs(_selected(), 1), *sp.long_runs(_selected(), 1))
CELLS = [run for run in LATER if run.seed == 0]


def _value(text: str):
    try:
        return ast.literal_eval(text)
    except (ValueError, SyntaxError):
        return text  # a bare word: an optimizer, a method, a rule


def _dotted(cfg: dict, key: str):
    for part in key.split("."):
        cfg = cfg[part]
    return cfg


@pytest.mark.parametrize("run", CELLS, ids=[f"{r.stage}/{r.name}" for r in CELLS])
def test_every_later_stage_cell_runs_through_fs_with_its_overrides(tiny_glue, tmp_path, monkeypatch, run):
    # Prepare: the protocol's N = 10, every client every round, on the tiny assets
    overrides = {"federate.client_num": sp.CLIENTS, "federate.sample_client_num": sp.CLIENTS}
    cfg = fs_glue_yaml(tmp_path, tiny_glue["model"], tiny_glue["glue"], **overrides, **{"train.local_update_steps": 2})
    for key, value in fs_env().items():
        monkeypatch.setenv(key, value)
    out = tmp_path / "run"
    # Execute: the runner's own call
    compare.run_one(dump_yaml(cfg, tmp_path / "base.yaml"), run.cell(), 0, out, [], "1")
    # Assert: it evaluated, and every override of the cell reached FS's config
    result = compare.collect(out)
    assert result["rounds"] and all(0 <= m["val_acc"] <= 1 for m in result["rounds"].values())
    used = yaml.safe_load((out / "run" / "config.yaml").read_text())
    assert used["federate"]["method"] == run.method
    for key, text in dict(zip(run.opts[::2], run.opts[1::2])).items():  # a key given twice: FS keeps the last
        if key == "federate.total_round_num":
            continue
        expected, got = _value(text), _dotted(used, key)
        assert got == (pytest.approx(expected) if isinstance(expected, float) else expected), key
    if run.stage == "adaptive":  # the run file keeps the λ_i^(t) the rule chose, within the rule's range
        lam0, rule = float(dict(zip(run.opts[::2], run.opts[1::2]))["fedpa.lam"]), used["fedpa"]["adaptive_lam"]
        high = {"loss": lam0, "direction": 2 * lam0, "grad": used["fedpa"]["lam_max"]}[rule]
        assert result["diagnostics"] and all(
            0 <= d["lam_min"] <= d["lam_mean"] <= d["lam_max"] <= high for d in result["diagnostics"]
        )
    if run.stage == "long":  # per-sentence outcomes: a partition of the dev set, and FS's accuracy per client
        outcomes = result["outcomes"]
        indices = sorted(i for shard in outcomes["shards"].values() for i in shard)
        assert indices == list(range(outcomes["size"])) and outcomes["split"] == "val"
        ((r, protocols),) = outcomes["rounds"].items()
        assert set(protocols) == {"global", "local"}
        for protocol, key in (("global", "val_acc"), ("local", "local.val_acc")):
            bits = "".join(protocols[protocol].values())
            assert result["rounds"][r][key] == pytest.approx(bits.count("1") / len(bits), abs=1e-12)
