"""The SST-2 protocol's committed run files and what is read from them: one small JSON file a run under
``<report>/runs/<stage>/`` (:func:`load_results`, :func:`write_run`), a cell's values per seed, the paired
intervals between cells with Holm's labels, the per-sentence scores of the long horizon and the time spent. Plain
Python over the files; the protocol's declaration (:mod:`research.study.sst2_protocol`) and the report read it. No
torch, no FS."""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from research.study import stats


def load_results(report: Path) -> dict[str, dict]:
    """``stage/name_sSEED -> run`` for every committed run file (rounds keyed by int again)."""
    out = {}
    for path in sorted((report / "runs").glob("*/*.json")):
        run = json.loads(path.read_text())
        run["rounds"] = {int(r): m for r, m in run["rounds"].items()}
        out[f"{path.parent.name}/{path.stem}"] = run
    return out



RUNNER_FIELDS = ("stage", "rounds_planned", "fs_opts", "jobs")  # what execute() adds to compare.collect()'s result



def write_run(report: Path, key: str, result: dict) -> dict:
    """Write one run's file ``runs/<stage>/<name>_s<seed>.json`` (compact JSON); returns ``result`` as
    :func:`load_results` reads it back (rounds keyed by int)."""
    path = report / "runs" / f"{key}.json"
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, separators=(",", ":")))
    return {**result, "rounds": {int(r): m for r, m in result["rounds"].items()}}



def final_metric(run: dict, metric: str) -> float | None:
    values = [m[metric] for _, m in sorted(run["rounds"].items()) if m.get(metric) is not None]
    return values[-1] if values else None



def cell_values(results: dict, metric: str, stage: str = "final", value=None) -> dict[str, dict[int, float]]:
    """``cell -> seed -> value(run, metric)`` of the runs of ``stage``; ``value`` is :func:`final_metric` unless
    given (the long horizon's :func:`endpoint`)."""
    value_of = value or final_metric
    cells: dict[str, dict[int, float]] = {}
    for key, run in results.items():
        if key.startswith(f"{stage}/") and (value := value_of(run, metric)) is not None:
            cells.setdefault(run["cell"], {})[run["seed"]] = value
    return cells



def paired_rows(results: dict, metric: str, stage: str = "final", ours: str = "fedpa", cells=None) -> dict[str, dict]:
    """Per other cell (of ``stage``, or ``cells``): the paired 95% interval of (ours − it) over their shared seeds."""
    cells = cell_values(results, metric, stage) if cells is None else cells
    rows = {}
    for cell, values in cells.items():
        seeds = sorted(set(values) & set(cells.get(ours, {})))
        if cell == ours or len(seeds) < 2:
            continue
        differences = [cells[ours][s] - values[s] for s in seeds]
        mean, low, high = stats.paired_interval(differences)
        rows[cell] = {"seeds": len(seeds), "mean": mean, "low": low, "high": high}
        rows[cell]["verdict"] = stats.verdict(low, high)
        rows[cell]["p"] = stats.paired_t_p(differences)
        rows[cell]["sd"] = statistics.stdev(differences)
    return rows



def with_holm(rows: dict[str, dict]) -> dict[str, dict]:
    """``rows`` (one family, each ``{"mean", "p"}``) with each row's Holm-adjusted p added as ``"holm_p"`` and its
    label as ``"holm"`` (wins / loses where the adjusted p < 0.05, else ties): the one place a Holm label is made."""
    if not rows:
        return {}
    adjusted = stats.holm({cell: row["p"] for cell, row in rows.items()})
    labels = stats.holm_verdicts(rows)
    return {cell: {**row, "holm_p": adjusted[cell], "holm": labels[cell]} for cell, row in rows.items()}



def sentence_scores(run: dict, protocol_name: str) -> tuple[list[float], list[int]]:
    """Per sentence of the evaluation file, the share of the run's stored evaluations (its last
    :data:`ENDPOINT_EVALS`) that got it right under ``protocol_name`` ("global": the paper protocol, "local": the own
    factors), and the client whose shard holds it. Their mean is :func:`endpoint` of the matching metric."""
    outcomes = run["outcomes"]
    size, shards = outcomes["size"], outcomes["shards"]
    right, client = [0.0] * size, [-1] * size
    evaluations = list(outcomes["rounds"].values())
    for cid, indices in shards.items():
        for j in indices:
            client[j] = int(cid)
    for evaluation in evaluations:
        for cid, bits in evaluation[protocol_name].items():
            for j, bit in zip(shards[cid], bits):
                right[j] += bit == "1"
    if -1 in client:
        raise ValueError(f"{run['cell']} seed {run['seed']}: the clients' shards do not cover the evaluation file")
    return [r / len(evaluations) for r in right], client



def time_spent(results: dict) -> str:
    """The committed runs' wall time and, for those that record it, their processes' CPU time (user + system,
    which concurrent work does not inflate)."""
    wall = sum(r["seconds"] for r in results.values()) / 3600
    machine = sum(r["seconds"] / r.get("jobs", 1) for r in results.values()) / 3600
    timed = [r for r in results.values() if "cpu_seconds" in r]
    text = f"{wall:.2f} h of wall time"
    if machine < wall:
        text += f" ({machine:.2f} h of machine time: wall time / runs side by side)"
    if timed:
        cpu = sum(r["cpu_seconds"] for r in timed) / 3600
        text += f", {cpu:.2f} CPU-h on the {len(timed)} of {len(results)} runs that record it"
    return text


NEAR = 0.006  # baselines whose per-seed final accuracies all lie closer than this are one finding, not several


def near_duplicates(results: dict, baselines: tuple[str, ...], metric: str = "val_acc",
                    within: float = NEAR) -> list[list[str]]:  # fmt: skip
    """Groups of final-stage ``baselines`` that are near-duplicates: linked by pairs whose final ``metric`` differs
    by less than ``within`` in every one of at least 3 shared seeds (connected components of those pairs), each in
    the order of ``baselines``."""
    cells = {c: v for c, v in cell_values(results, metric).items() if c in baselines}
    linked: dict[str, set[str]] = {c: set() for c in cells}
    for a in cells:
        for b in cells:
            seeds = set(cells[a]) & set(cells[b])
            if a < b and len(seeds) >= 3 and all(abs(cells[a][s] - cells[b][s]) < within for s in seeds):
                linked[a].add(b)
                linked[b].add(a)
    groups, seen = [], set()
    for c in baselines:
        if c in linked and c not in seen and linked[c]:
            group, todo = set(), [c]
            while todo:
                x = todo.pop()
                if x not in group:
                    group.add(x)
                    todo += linked[x]
            seen |= group
            groups.append([b for b in baselines if b in group])
    return groups
