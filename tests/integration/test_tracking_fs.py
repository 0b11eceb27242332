"""A real FS run feeds its tracker from the server (issue 90), read back with each tracker's own reader: per round
the global metric, each client's training seconds and the peak memory; under sample-level DP each client's epsilon
(and no client timing: those stay with the client). Also the run's summary names the tracker and how to open it."""

from __future__ import annotations

import json

import pytest

from tests.integration.conftest import fedpa_cfg
from tests.integration.tiny_assets import outdir_of, run_fs
from tests.tracker_readers import read_mlflow, read_tensorboard, read_wandb

pytestmark = pytest.mark.integration
ROUNDS = 3
DP = {"fedpa.dp.mode": "sample", "fedpa.dp.clip": 1.0, "fedpa.dp.noise_multiplier": 1.0}
PACKAGES = {"tensorboard": "tensorboardX", "mlflow": "mlflow", "wandb": "wandb"}


def _run(tiny_llm, tmp_path, kind: str, dp: bool) -> tuple[dict, dict]:
    """A 3-round run with ``fedpa.track kind``: its scalars ``{key: {round: value}}`` and its summary."""
    pytest.importorskip(PACKAGES[kind], reason=f"fedpa.track {kind} is NOT tested: pip install 'fs_fedpa[track]'")
    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"federate.total_round_num": ROUNDS, "fedpa.track": kind,
                                           **(DP if dp else {})})  # fmt: skip
    # W&B offline (the tests' environment disables it for FS), MLflow in the run folder
    proc = run_fs(cfg, tmp_path, env={"WANDB_MODE": "offline", "MLFLOW_TRACKING_URI": ""})
    assert proc.returncode == 0, proc.stderr[-3000:]
    folder = outdir_of(cfg)
    summary = json.loads((folder / "summary.json").read_text())
    tracking = folder / "tracking"
    if kind == "tensorboard":
        scalars = read_tensorboard(tracking / "tensorboard")
    elif kind == "mlflow":
        scalars = read_mlflow(f"sqlite:///{tracking / 'mlflow.db'}")
    else:
        scalars = read_wandb(tracking)
    assert summary["tracker"]["kind"] == kind and summary["tracker"]["open"]
    assert f"[fedpa] its {kind} records: {summary['tracker']['open']}" in proc.stdout + proc.stderr
    return scalars, summary


@pytest.mark.parametrize("kind", ["tensorboard", "mlflow", "wandb"])
def test_the_tracker_holds_the_rounds_metric_training_seconds_and_peak_memory(tiny_llm, tmp_path, kind):
    scalars, summary = _run(tiny_llm, tmp_path, kind, dp=False)
    rounds = set(range(ROUNDS))
    # the global metric, as the summary's curve has it
    assert {e["round"]: e["global"]["val_loss"] for e in summary["curve"]} == pytest.approx(scalars["global/val_loss"])
    for client in ("1", "2", "3"):  # every client trains every round here
        seconds = scalars[f"client/{client}/train_seconds"]
        assert set(seconds) == rounds and all(s > 0 for s in seconds.values())
    assert set(scalars["systems/peak_memory_mib"]) == rounds
    assert max(scalars["systems/peak_memory_mib"].values()) * 2**20 == pytest.approx(summary["peak_memory"]["bytes"])
    assert set(scalars["diagnostics/e_agg"]) == rounds  # the method's diagnostics


@pytest.mark.parametrize("kind", ["tensorboard", "mlflow", "wandb"])
def test_under_dp_the_tracker_holds_each_clients_epsilon_and_no_client_timing(tiny_llm, tmp_path, kind):
    scalars, summary = _run(tiny_llm, tmp_path, kind, dp=True)
    epsilons = summary["privacy"]["epsilon"]
    assert set(epsilons) == {"1", "2", "3"} and summary["privacy"]["epsilon_max"] == max(epsilons.values())
    for client, epsilon in epsilons.items():  # the ledger's last line, as the tracker got it in the last round
        assert scalars[f"client/{client}/epsilon"][ROUNDS - 1] == pytest.approx(epsilon, rel=1e-6)
    assert not any(key.endswith("/train_seconds") for key in scalars)
    assert set(scalars["global/val_loss"]) == set(range(ROUNDS)) and scalars["systems/peak_memory_mib"]
