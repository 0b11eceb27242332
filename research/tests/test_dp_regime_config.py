"""yaml_configs/dp_sst2_minilm_cpu.yaml is what research/scripts/make_dp_regime_config.py writes from the committed
search, and it is the protocol's config changed in exactly the selected regime's knobs and DP-SGD at ε = 8."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _flat(node: dict, prefix: str = "") -> dict:
    out = {}
    for key, value in node.items():
        if isinstance(value, dict):
            out.update(_flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


def test_the_committed_config_is_what_the_generator_writes():
    proc = subprocess.run([sys.executable, "research/scripts/make_dp_regime_config.py", "--check"], cwd=ROOT,
                          capture_output=True, text=True)  # fmt: skip
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_it_differs_from_the_protocol_in_the_selected_regime_and_its_dp_only():
    dp = _flat(yaml.safe_load((ROOT / "yaml_configs" / "dp_sst2_minilm_cpu.yaml").read_text()))
    base = _flat(yaml.safe_load((ROOT / "yaml_configs" / "compare_sst2_protocol.yaml").read_text()))
    changed = {k: dp.get(k) for k in dp.keys() | base.keys() if dp.get(k) != base.get(k)}
    # the dpvalid search's selected run, search_frozen_c0.01_lr0.01 (the dpregime regime with the head frozen),
    # written out by hand
    assert changed == {
        "expname": "sst2_dp", "federate.method": "fedit", "federate.total_round_num": 120,
        "dataloader.batch_size": 256, "train.local_update_steps": 1, "eval.freq": 30,
        "model.seqcls.layers_to_transform": [4, 5], "model.seqcls.prefix_cache": True,
        "train.optimizer.lr": 0.01, "fedpa.lr_schedule": "constant", "fedpa.lr_warmup_steps": 12,
        "fedpa.dp.mode": "sample", "fedpa.dp.epsilon": 8, "fedpa.dp.clip": 0.01, "fedpa.dp.sampling": "poisson",
        "fedpa.dp.accountant": "pld", "fedpa.dp.horizon": 120, "fedpa.dp.min_records": 1000,
        "fedpa.dp.local_tensors": "frozen", "fedpa.dp.chunk": 32,
        "fedpa.records.diagnostics": None,  # the study's full diagnostics left out: a user's run records light ones
    }  # fmt: skip
    assert dp["personalization.local_param"] == ["classifier"] and dp["train.optimizer.type"] == "AdamW"
    assert dp["data.glue_holdout"] == 0  # the dev set, as the protocol's own file
