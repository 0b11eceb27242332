"""fs_fedpa.tracking, each backend read back with its own reader (tests/tracker_readers.py): what was logged is
there at its round, a step that comes after a larger one included, and a NaN or a non-number is not."""

from __future__ import annotations

import importlib.abc
import json
import math
import subprocess
import sys

import pytest

from fs_fedpa import tracking
from tests import tracker_readers
from tests.conftest import ROOT

BACKENDS = {  # kind: the module its test needs, beside the writer's (the reader's package)
    "tensorboard": "tensorboard",
    "wandb": "wandb",
    "mlflow": "mlflow",
}
# (step, scalars): round 1's evaluation comes after round 2's aggregation; a NaN, an inf and a string are skipped
LOGS = [
    (0, {"global/val_acc": 0.5, "systems/aggregate_seconds": 1.25, "diagnostics/E_agg": float("nan")}),
    (1, {"systems/aggregate_seconds": 1.5, "client/1/val_acc": 0.25}),
    (2, {"systems/aggregate_seconds": 1.75, "privacy/epsilon_max": float("inf"), "note": "text"}),
    (1, {"global/val_acc": 0.625, "own/val_acc": 0.5}),
]
EXPECTED = {
    "global/val_acc": {0: 0.5, 1: 0.625},
    "systems/aggregate_seconds": {0: 1.25, 1: 1.5, 2: 1.75},
    "client/1/val_acc": {1: 0.25},
    "own/val_acc": {1: 0.5},
}
CONFIG = {"federate": {"method": "fedpa", "total_round_num": 3}, "fedpa": {"lam": 0.5, "client_ranks": [2, 4]}}


def _needs(kind: str) -> None:
    try:
        tracking.check_kind(kind)
    except ValueError as err:
        pytest.skip(f"the {kind} tracker's packages do not import here ({err})")
    pytest.importorskip(BACKENDS[kind], reason=f"the {kind} test reads back with {BACKENDS[kind]}'s own reader")


def _read(kind: str, tracker, folder) -> dict:
    if kind == "tensorboard":
        return tracker_readers.read_tensorboard(folder / "tensorboard")
    if kind == "mlflow":
        return tracker_readers.read_mlflow(tracker.uri)
    return tracker_readers.read_wandb(folder)


@pytest.fixture(autouse=True)
def _offline(monkeypatch):
    for name in ("WANDB_MODE", "MLFLOW_TRACKING_URI", "MLFLOW_EXPERIMENT_NAME", "WANDB_PROJECT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("WANDB_ERROR_REPORTING", "false")  # W&B's own crash reports: no network from a test


@pytest.mark.parametrize("kind", sorted(BACKENDS))
def test_a_backend_keeps_every_finite_scalar_at_its_round(kind, tmp_path):
    _needs(kind)
    # Prepare
    folder = tmp_path / "tracking"
    tracker = tracking.open_tracker(kind, str(folder), "run-a", CONFIG)
    # Execute
    for step, scalars in LOGS:
        tracker.log(step, scalars)
    tracker.close()
    tracker.log(3, {"global/val_acc": 0.75})  # after close: nothing, no error
    # Assert
    got = _read(kind, tracker, folder)
    assert set(got) == set(EXPECTED)
    for key, steps in EXPECTED.items():
        assert got[key] == pytest.approx(steps, rel=1e-6), key  # TensorBoard keeps float32
    assert tracker.kind == kind and tracker.open_command()


def test_tensorboard_opens_with_its_folder(tmp_path):
    _needs("tensorboard")
    tracker = tracking.open_tracker("tensorboard", str(tmp_path / "tracking"), "run", {})
    tracker.close()
    assert tracker.open_command() == f"tensorboard --logdir {tmp_path / 'tracking' / 'tensorboard'}"


def test_wandb_is_offline_by_default_and_says_how_to_sync(tmp_path):
    _needs("wandb")
    tracker = tracking.open_tracker("wandb", str(tmp_path), "run-w", CONFIG)
    tracker.log(0, {"global/val_acc": 0.5})
    tracker.close()
    command = tracker.open_command()
    assert command.startswith(f"wandb sync {tmp_path / 'wandb'}/offline-run-")
    records = tracker_readers.wandb_records(tmp_path)
    run = next(r.run for r in records if r.WhichOneof("record_type") == "run")
    assert run.display_name == "run-w" and run.project == "fs_fedpa"
    config = {item.key: json.loads(item.value_json) for item in run.config.update}
    assert config["fedpa"] == CONFIG["fedpa"] and config["federate"] == CONFIG["federate"]


def test_mlflow_stores_in_sqlite_in_the_folder_with_the_config_as_params(tmp_path):
    _needs("mlflow")
    config = {**CONFIG, "data": {"root": "x" * 7000, "bad:key?": 1}, "__help_info__": {"data.root": "help"}}
    tracker = tracking.open_tracker("mlflow", str(tmp_path), "run-m", config)
    tracker.log(0, {"a:b/c": 1.0})  # ':' is refused on Windows: cleaned everywhere
    tracker.close()
    assert (tmp_path / "mlflow.db").is_file() and not (tmp_path / "mlruns").exists()
    uri = f"sqlite:///{tmp_path.resolve() / 'mlflow.db'}"
    assert tracker.open_command() == f"mlflow ui --backend-store-uri {uri}"
    params = tracker_readers.read_mlflow_params(uri)
    assert params["federate.method"] == "fedpa" and params["fedpa.client_ranks"] == "[2, 4]"
    assert params["fedpa.lam"] == "0.5" and len(params["data.root"]) == 6000 and params["data.bad_key_"] == "1"
    assert not any(key.startswith("__") for key in params)  # an FS CN's help texts are no settings
    assert tracker_readers.read_mlflow(uri) == {"a_b/c": {0: 1.0}}
    from mlflow.tracking import MlflowClient

    (run,) = MlflowClient(uri).search_runs([MlflowClient(uri).get_experiment_by_name("fs_fedpa").experiment_id])
    assert run.info.run_name == "run-m" and run.info.status == "FINISHED"


def test_mlflow_takes_the_store_and_experiment_from_the_environment(tmp_path, monkeypatch):
    _needs("mlflow")
    uri = f"sqlite:///{tmp_path / 'shared.db'}"
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_EXPERIMENT_NAME", "study")
    for name in ("one", "two"):  # the second run finds the experiment
        tracker = tracking.open_tracker("mlflow", str(tmp_path / name), name, {})
        tracker.log(0, {f"{name}/acc": 0.5})
        tracker.close()
    assert not (tmp_path / "one" / "mlflow.db").exists()
    assert tracker_readers.read_mlflow(uri) == {"one/acc": {0: 0.5}, "two/acc": {0: 0.5}}
    from mlflow.tracking import MlflowClient

    assert MlflowClient(uri).get_experiment_by_name("study") is not None


def test_a_backend_that_fails_is_warned_once_and_turned_off(monkeypatch):
    class Flaky(tracking._Backend):
        kind = "tensorboard"
        calls = 0

        def _write(self, step, values):
            Flaky.calls += 1
            raise OSError("No space left on device")

        def _close(self):
            raise AssertionError("a tracker turned off is not closed again")

    warned: list[str] = []
    monkeypatch.setattr(tracking.logger, "warning", warned.append)
    tracker = Flaky()
    tracker.log(0, {"a": 1.0})
    tracker.log(1, {"a": 2.0})
    tracker.close()
    assert Flaky.calls == 1
    assert warned == ["fedpa.track tensorboard: log failed (OSError: No space left on device); this run's tracker is "
                      "off from here"]  # fmt: skip


def test_a_bad_step_is_skipped_with_one_warning_and_the_tracker_stays_on(monkeypatch):
    class Recording(tracking._Backend):
        kind = "mlflow"
        seen: list = []

        def _write(self, step, values):
            self.seen.append(step)

    warned: list[str] = []
    monkeypatch.setattr(tracking.logger, "warning", warned.append)
    tracker = Recording()
    tracker.log(-1, {"a": 1.0})
    tracker.log(1.5, {"a": 1.0})
    tracker.log(0, {"a": 1.0})  # the tracker stays on
    assert tracker.seen == [0] and len(warned) == 1 and "step -1 is not a round >= 0" in warned[0]


def test_only_finite_real_numbers_are_kept():
    import numpy as np

    got = tracking.finite_scalars({"a": 1, "b": np.float32(0.5), "c": math.nan, "d": -math.inf, "e": True,
                                   "f": "0.5", "g": None, "h": np.int64(3)})  # fmt: skip
    assert got == {"a": 1.0, "b": 0.5, "h": 3.0} and all(type(v) is float for v in got.values())


def test_an_unknown_kind_is_refused_naming_the_kinds():
    message = "fedpa.track(='comet') must be one of ('none', 'tensorboard', 'wandb', 'mlflow')"
    with pytest.raises(ValueError, match=rf"^{message.replace('(', '[(]').replace(')', '[)]')}$"):
        tracking.open_tracker("comet", "unused", "run", {})


@pytest.mark.parametrize("kind,missing,package", [("tensorboard", "tensorboardX", "tensorboardX"),
                                                  ("wandb", "wandb", "wandb"), ("mlflow", "alembic", "alembic"),
                                                  ("mlflow", "mlflow", "mlflow-skinny")])  # fmt: skip
def test_a_missing_package_is_one_line_naming_the_extra(kind, missing, package, monkeypatch, tmp_path):
    for name in [m for m in sys.modules if m == missing or m.startswith(f"{missing}.")]:
        monkeypatch.delitem(sys.modules, name)

    class Absent(importlib.abc.MetaPathFinder):  # first on the path: the package is not installed
        def find_spec(self, name, path=None, target=None):
            if name == missing or name.startswith(f"{missing}."):
                raise ModuleNotFoundError(f"No module named {missing!r}", name=missing)

    monkeypatch.setattr(sys, "meta_path", [Absent(), *sys.meta_path])
    expected = f'fedpa.track {kind} needs {package}: pip install "fs_fedpa[track]" (No module named {missing!r})'
    for call in (lambda: tracking.check_kind(kind), lambda: tracking.open_tracker(kind, str(tmp_path), "r", {})):
        with pytest.raises(ValueError) as err:
            call()
        assert str(err.value) == expected
    assert not any(tmp_path.iterdir())  # refused before anything was written


def test_none_does_nothing_and_imports_no_backend(tmp_path):
    code = (
        "import sys\n"
        "from fs_fedpa.tracking import open_tracker\n"
        f"t = open_tracker('none', {str(tmp_path / 'tracking')!r}, 'run', {{'a': 1}})\n"
        "t.log(0, {'global/val_acc': 0.5}); t.close()\n"
        "assert t.kind == 'none' and t.open_command() is None\n"
        "print(sorted(m for m in ('tensorboardX', 'tensorboard', 'wandb', 'mlflow', 'sqlalchemy', 'alembic', "
        "'torch', 'federatedscope') if m in sys.modules))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[]"
    assert not (tmp_path / "tracking").exists()
