"""Read what a tracker wrote back with each backend's own reader, for the tests (none of fs_fedpa's code).

Each returns ``{name: {step: value}}``; a step logged twice keeps its last value. A backend's package that is missing
raises ImportError: the callers skip on it.
"""

from __future__ import annotations

import json
from pathlib import Path


def read_tensorboard(folder) -> dict[str, dict[int, float]]:
    """The scalars of the event files in ``folder`` (``<tracking>/tensorboard``), read by TensorBoard's
    EventAccumulator (values are float32 there)."""
    from tensorboard.backend.event_processing.event_accumulator import SCALARS, EventAccumulator

    acc = EventAccumulator(str(folder), size_guidance={SCALARS: 0})  # 0: keep every event
    acc.Reload()
    return {tag: {e.step: e.value for e in acc.Scalars(tag)} for tag in acc.Tags()[SCALARS]}


def read_mlflow(uri: str) -> dict[str, dict[int, float]]:
    """The metrics of every run of every experiment in the MLflow store at ``uri``
    (``sqlite:///<tracking>/mlflow.db``), by MlflowClient.get_metric_history."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    out: dict[str, dict[int, float]] = {}
    experiments = [e.experiment_id for e in client.search_experiments()]
    for run in client.search_runs(experiments):
        for key in run.data.metrics:
            for m in sorted(client.get_metric_history(run.info.run_id, key), key=lambda m: m.timestamp):
                out.setdefault(key, {})[m.step] = m.value
    return out


def read_mlflow_params(uri: str) -> dict[str, str]:
    """The parameters of the runs in the MLflow store at ``uri``."""
    from mlflow.tracking import MlflowClient

    client = MlflowClient(uri)
    runs = client.search_runs([e.experiment_id for e in client.search_experiments()])
    return {k: v for run in runs for k, v in run.data.params.items()}


def wandb_records(folder) -> list:
    """Every record (``wandb_internal_pb2.Record``) of the ``.wandb`` files of offline runs under ``folder``."""
    from wandb.proto import wandb_internal_pb2
    from wandb.sdk.internal.datastore import DataStore

    records = []
    for path in sorted(Path(folder).rglob("run-*.wandb")):
        store = DataStore()
        store.open_for_scan(str(path))
        while (data := store.scan_data()) is not None:
            record = wandb_internal_pb2.Record()
            record.ParseFromString(data)
            records.append(record)
    return records


def read_wandb(folder) -> dict[str, dict[int, float]]:
    """The history rows of the W&B offline runs under ``folder`` (``<tracking>``), by the ``round`` key of each
    row (W&B's own ``_step``, ``_runtime``, ``_timestamp`` and ``round`` itself left out)."""
    out: dict[str, dict[int, float]] = {}
    for record in wandb_records(folder):
        if record.WhichOneof("record_type") != "history":
            continue
        row = {item.key or "/".join(item.nested_key): json.loads(item.value_json) for item in record.history.item}
        if "round" not in row:
            continue
        for key, value in row.items():
            if key != "round" and not key.startswith("_"):
                out.setdefault(key, {})[int(row["round"])] = value
    return out
