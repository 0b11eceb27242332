"""What the comparison reads from a run beyond its weighted averages (:mod:`fs_fedpa.fs_results`): each client's own
last evaluation in FS's ``eval_results.log``, the DP-SGD clients' own accounting files, the server's privacy ledger
and the per-example outcomes."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fs_fedpa.fs_results import rows
from fs_fedpa.record import EVAL_SHARDS_FILE, OUTCOMES_FILE, PRIVACY_FILE

_CLIENT = re.compile(r"Client #(\d+)$")
CLIENT_KEYS = ("val_acc", "val_f1", "val_total", "local.val_acc", "local.val_f1")


def clients_last_round(path: str | Path) -> dict[str, dict]:
    """Each client's own evaluation at its last round in ``path`` (``{client: {key: value}}`` for the keys of
    :data:`CLIENT_KEYS` it has, floats to 4 decimals), which the weighted average hides: e.g. which clients of a run
    predict one label. Empty when the file holds no client's row."""
    last: dict[str, tuple[int, dict]] = {}
    for row in rows(path):
        client = _CLIENT.match(str(row.get("Role", "")))
        if client and isinstance(row.get("Results_raw"), dict) and row["Round"] >= last.get(client[1], (-1,))[0]:
            last[client[1]] = (row["Round"], row["Results_raw"])
    return {
        c: {k: round(raw[k], 4) if isinstance(raw[k], float) else raw[k] for k in CLIENT_KEYS if k in raw}
        for c, (_, raw) in sorted(last.items(), key=lambda item: int(item[0]))
    }


def read_noise_signal(folder: str | Path) -> dict[str, list[float | None]]:
    """Each DP-SGD client's noise/signal per round from its own accounting file
    (:data:`~fs_fedpa.record.CLIENT_PRIVACY_FILE`): ``{client: [||noise|| / ||clipped sum||, ...]}`` in the file's
    order, 3 significant digits; None where the clipped sum is 0 or unknown. Empty without DP-SGD."""
    from fs_fedpa.record import CLIENT_PRIVACY_FILE

    path, out = Path(folder) / CLIENT_PRIVACY_FILE, {}
    for line in path.read_text().splitlines() if path.is_file() else []:
        if not line.strip():
            continue
        row = json.loads(line)
        signal, noise = row.get("clipped_sum"), row.get("noise")
        ratio = float(f"{noise / signal:.3g}") if signal and noise is not None else None
        out.setdefault(str(row["client"]), []).append(ratio)
    return out


def read_privacy(folder: Path) -> dict | None:
    """What a DP run spent, from its ledger (None without one): the ledger's last line (the final ε at the run's δ,
    the sampling, adjacency, clip and sensitivity; in sample mode each client's ε, δ, noise multiplier and steps)
    and ``epsilon_by_round``, the cumulative ε after each round."""
    path = folder / PRIVACY_FILE
    if not path.is_file():
        return None
    lines = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    if not lines:
        return None
    return {**lines[-1], "epsilon_by_round": {int(r["round"]): r["dp_epsilon"] for r in lines}}


OUTCOME_EVALS = 3  # a run file keeps the per-example outcomes of its last this many evaluations


def read_outcomes(folder: Path, last: int = OUTCOME_EVALS) -> dict | None:
    """The per-example outcomes of a run with ``fedpa.records.save_outcomes`` (None without them), for its ``last``
    evaluations: ``{"size": n, "split": s, "shards": {client: [index into the evaluation file, ...]},
    "rounds": {round: {protocol: {client: "0110..."}}}}``, the bits in the order of the client's shard."""
    shards_file, outcomes_file = folder / EVAL_SHARDS_FILE, folder / OUTCOMES_FILE
    if not (shards_file.is_file() and outcomes_file.is_file()):
        return None
    shards = json.loads(shards_file.read_text())
    lines = [json.loads(line) for line in outcomes_file.read_text().splitlines() if line.strip()]
    splits = {line["split"] for line in lines} & set(shards["splits"])
    if len(splits) != 1:
        raise ValueError(f"{outcomes_file}: expected outcomes of one split of the evaluation file, got {splits}")
    split = splits.pop()
    clients = shards["splits"][split]
    rounds: dict[int, dict[str, dict[str, str]]] = {}
    for line in (line for line in lines if line["split"] == split):
        client, bits = str(line["client"]), line["correct"]
        if len(bits) != len(clients.get(client, ())):
            raise ValueError(
                f"{outcomes_file}: round {line['round']}, {line['protocol']}, client {client}: {len(bits)} outcomes "
                f"for a shard of {len(clients.get(client, ()))} examples"
            )
        rounds.setdefault(line["round"], {}).setdefault(line["protocol"], {})[client] = bits
    kept = sorted(rounds)[-last:]
    return {"size": shards["size"], "split": split, "shards": clients, "rounds": {r: rounds[r] for r in kept}}
