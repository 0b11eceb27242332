"""Experiment trackers the server feeds each round (``fedpa.track``): TensorBoard, Weights & Biases, MLflow.

No FederatedScope and no torch here, and no backend at import: a backend's package is imported only when a tracker
of its kind is checked or opened, so ``fedpa.track none`` imports nothing. A tracker takes ``log(step, scalars)``
with ``step`` the FS round (0-based); calls may repeat a step or come after a larger one (the evaluation of round r
after round r + 1's aggregation), which each backend keeps as given. Inside ``log`` and ``close`` nothing raises: a
value that is not a finite number is skipped, and a backend that fails is warned about once and turned off, so
the federation goes on.
"""

from __future__ import annotations

import importlib
import json
import logging
import math
import numbers
import os
import posixpath
import re
import shlex
import time
from pathlib import Path

KINDS = ("none", "tensorboard", "wandb", "mlflow")
EXTRA = 'pip install "fs_fedpa[track]"'
# the modules each kind imports, with the package that brings each (tensorboard: tensorboardX writes the files;
# mlflow: the default store is SQLite, which MLflow reaches through sqlalchemy and alembic)
NEEDS = {
    "none": (),
    "tensorboard": (("tensorboardX", "tensorboardX"),),
    "wandb": (("wandb", "wandb"),),
    "mlflow": (("mlflow", "mlflow-skinny"), ("sqlalchemy", "sqlalchemy"), ("alembic", "alembic")),
}
KEY_MAX, PARAM_VALUE_MAX, PARAMS_PER_BATCH, METRICS_PER_BATCH = 250, 6000, 100, 1000  # MLflow's limits
logger = logging.getLogger(f"federatedscope.{__name__}")


def check_kind(kind: str) -> None:
    """Raise a one-line ValueError for an unknown ``kind`` or one whose packages do not import (naming the extra)."""
    if kind not in KINDS:
        raise ValueError(f"fedpa.track(={kind!r}) must be one of {KINDS}")
    for module, package in NEEDS[kind]:
        try:
            importlib.import_module(module)
        except Exception as err:  # ImportError, or a broken install (a protobuf too old or too new)
            reason = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
            raise ValueError(f"fedpa.track {kind} needs {package}: {EXTRA} ({reason})") from None


def open_tracker(kind: str, folder: str, name: str, config: dict) -> Tracker:
    """A tracker of ``kind`` writing under ``folder`` (made if missing), its run called ``name``, with the run's
    ``config`` (a nested dict) as its parameters; ``"none"``: one that does nothing and imports nothing.
    ValueError (one line) for an unknown kind, a missing package, or a backend that fails to start."""
    check_kind(kind)
    if kind == "none":
        return Tracker()
    folder = Path(folder).resolve()  # the open command works from any folder
    folder.mkdir(parents=True, exist_ok=True)
    backend = {"tensorboard": _TensorBoard, "wandb": _WandB, "mlflow": _MLflow}[kind]
    try:
        return backend(str(folder), name, config)
    except Exception as err:
        raise ValueError(f"fedpa.track {kind}: the tracker did not start: {_first_line(err)}") from None


class Tracker:
    """The interface, and the tracker of ``fedpa.track none``: every method does nothing."""

    kind = "none"

    def log(self, step: int, scalars: dict[str, float]) -> None:
        """Record ``scalars`` (``{"global/val_acc": 0.61, ...}``) at round ``step``; never raises."""

    def close(self) -> None:
        """Flush and end the run; later calls of ``log`` do nothing."""

    def open_command(self) -> str | None:
        """The shell command that opens what the tracker wrote (None: nothing to open)."""
        return None


class _Backend(Tracker):
    """What every backend shares: values filtered to finite floats, and a failure warned once and turned off."""

    def __init__(self) -> None:
        self._on, self._bad_step = True, False

    def log(self, step: int, scalars: dict[str, float]) -> None:
        if not self._on:
            return
        if isinstance(step, bool) or not isinstance(step, numbers.Integral) or step < 0:
            if not self._bad_step:  # skipped, the tracker kept on: warned once
                logger.warning(f"fedpa.track {self.kind}: step {step!r} is not a round >= 0; its scalars are skipped")
            self._bad_step = True
            return
        values = finite_scalars(scalars)
        if values:
            self._guard("log", self._write, int(step), values)

    def close(self) -> None:
        if self._on:
            self._guard("close", self._close)
            self._on = False

    def _guard(self, what: str, call, *args) -> None:
        try:
            call(*args)
        except Exception as err:  # a full disk, a lost connection, a backend's bug: the federation goes on
            self._fail(what, _first_line(err))

    def _fail(self, what: str, reason: str) -> None:
        self._on = False
        logger.warning(f"fedpa.track {self.kind}: {what} failed ({reason}); this run's tracker is off from here")

    def _write(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def _close(self) -> None:
        raise NotImplementedError


class _TensorBoard(_Backend):
    """Event files in ``<folder>/tensorboard`` (tensorboardX: TensorBoard's own writer needs protobuf >= 5 from
    tensorboard 2.21 on, and FederatedScope's gRPC code protobuf 3.20)."""

    kind = "tensorboard"

    def __init__(self, folder: str, name: str, config: dict) -> None:
        super().__init__()
        from tensorboardX import SummaryWriter

        self.dir = str(Path(folder) / "tensorboard")
        self.writer = SummaryWriter(logdir=self.dir, flush_secs=30)
        self.writer.add_text("config", "```\n" + json.dumps(_plain(config), indent=1, default=str) + "\n```", 0)

    def _write(self, step: int, values: dict[str, float]) -> None:
        for tag, value in values.items():
            self.writer.add_scalar(tag, value, global_step=step)

    def _close(self) -> None:
        self.writer.close()

    def open_command(self) -> str | None:
        return f"tensorboard --logdir {shlex.quote(self.dir)}"


class _WandB(_Backend):
    """A W&B run under ``<folder>/wandb``, offline unless WANDB_MODE says otherwise (no credentials, no network).

    Each row carries its round under the key ``round``, W&B's x axis for every metric: W&B drops a row whose
    ``step=`` is below one it has logged, and an evaluation may arrive after the next round's aggregation."""

    kind = "wandb"

    def __init__(self, folder: str, name: str, config: dict) -> None:
        super().__init__()
        import wandb

        self.run = wandb.init(
            mode=os.environ.get("WANDB_MODE", "offline"),
            dir=folder,
            project=os.environ.get("WANDB_PROJECT", "fs_fedpa"),
            name=name,
            config=_plain(config),
            reinit="create_new",  # this run only, through its handle: wandb.run and any other run stay as they are
            settings=wandb.Settings(silent=True, console="off"),  # FS's console stays FS's
        )
        self.run.define_metric("round", hidden=True)
        self.run.define_metric("*", step_metric="round")

    def _write(self, step: int, values: dict[str, float]) -> None:
        self.run.log({**values, "round": step})

    def _close(self) -> None:
        self.run.finish()

    def open_command(self) -> str | None:
        if self.run.settings.mode == "offline":
            return f"wandb sync {shlex.quote(str(self.run.settings.sync_dir))}"
        url = getattr(self.run, "url", None)
        return f"python -m webbrowser {shlex.quote(url)}" if url else None


class _MLflow(_Backend):
    """An MLflow run in MLFLOW_TRACKING_URI, or else in the SQLite store ``<folder>/mlflow.db`` (MLflow 3 refuses
    its plain file store unless told to); experiment MLFLOW_EXPERIMENT_NAME or ``fs_fedpa``. The config goes in as
    flattened parameters (``train.optimizer.lr``), cut to MLflow's lengths."""

    kind = "mlflow"

    def __init__(self, folder: str, name: str, config: dict) -> None:
        super().__init__()
        from mlflow.entities import Param
        from mlflow.exceptions import MlflowException
        from mlflow.tracking import MlflowClient

        if not os.environ.get("MLFLOW_LOGGING_LEVEL"):  # MLflow sets its level at import: after it
            logging.getLogger("mlflow").setLevel(logging.WARNING)  # its INFO lines on creating the tables

        self.uri = os.environ.get("MLFLOW_TRACKING_URI") or f"sqlite:///{Path(folder) / 'mlflow.db'}"
        self.client = MlflowClient(self.uri)
        experiment = os.environ.get("MLFLOW_EXPERIMENT_NAME") or "fs_fedpa"
        found = self.client.get_experiment_by_name(experiment)
        if found is None:
            # our own store keeps artifacts beside it (MLflow's default is ./mlruns of whatever folder it runs in)
            where = None if os.environ.get("MLFLOW_TRACKING_URI") else (Path(folder) / "mlartifacts").as_uri()
            try:
                experiment_id = self.client.create_experiment(experiment, artifact_location=where)
            except MlflowException:  # another run created it in the meantime
                experiment_id = self.client.get_experiment_by_name(experiment).experiment_id
        else:
            experiment_id = found.experiment_id
        self.run_id = self.client.create_run(experiment_id, run_name=name).info.run_id
        flat: dict[str, str] = {}
        for key, value in _flatten(config).items():  # keys alike once cleaned and cut: the first stays
            flat.setdefault(_mlflow_name(key), value[:PARAM_VALUE_MAX])
        params = [Param(key, value) for key, value in flat.items()]
        for i in range(0, len(params), PARAMS_PER_BATCH):
            self.client.log_batch(self.run_id, params=params[i : i + PARAMS_PER_BATCH])

    def _write(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(_mlflow_name(key), value, now, step) for key, value in values.items()]
        for i in range(0, len(metrics), METRICS_PER_BATCH):
            self.client.log_batch(self.run_id, metrics=metrics[i : i + METRICS_PER_BATCH])

    def _close(self) -> None:
        self.client.set_terminated(self.run_id)

    def open_command(self) -> str | None:
        return f"mlflow ui --backend-store-uri {shlex.quote(self.uri)}"


def finite_scalars(scalars) -> dict[str, float]:
    """``{name: float(value)}`` for the entries of ``scalars`` that are real, finite numbers (bools and anything
    else are left out)."""
    out = {}
    for key, value in dict(scalars or {}).items():
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            continue
        value = float(value)
        if math.isfinite(value):
            out[str(key)] = value
    return out


def _mlflow_name(name: str) -> str:
    """``name`` as MLflow accepts a metric or parameter name: characters other than alphanumerics, ``_ - . /`` and
    space become ``_``, and empty, ``.`` and ``..`` path segments go (MLflow refuses names that normalise away),
    cut to MLflow's 250 characters."""
    name = re.sub(r"[^/\w.\- ]", "_", name[:KEY_MAX])
    parts = [p for p in name.split("/") if p not in ("", ".", "..")]
    return posixpath.join(*parts) if parts else "_"


def _plain(value):
    """A nested mapping (an FS ``CN`` included) as plain dicts and lists, JSON-able (anything else as its str),
    without dunder keys (a ``CN``'s ``__help_info__`` and ``__cfg_check_funcs__`` are no settings)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items() if not (str(k).startswith("__") and str(k).endswith("__"))}
    if isinstance(value, (list, tuple, set)):
        return [_plain(v) for v in value]
    return json.loads(json.dumps(value, default=str))


def _flatten(config, prefix: str = "") -> dict[str, str]:
    """``{"train.optimizer.lr": "0.01", ...}``: the leaves of a nested mapping under dotted keys, as strings."""
    out: dict[str, str] = {}
    for key, value in _plain(dict(config or {})).items():
        if isinstance(value, dict) and value:
            out.update(_flatten(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value if isinstance(value, str) else json.dumps(value)
    return out


def _first_line(err: BaseException) -> str:
    text = str(err).strip()
    return f"{type(err).__name__}: {text.splitlines()[0]}" if text else type(err).__name__
