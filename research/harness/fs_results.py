"""What the comparison reads from a run beyond its weighted averages (:mod:`fs_fedpa.fs_results`): each client's own
last evaluation in FS's ``eval_results.log`` and the DP-SGD clients' own accounting files."""

from __future__ import annotations

import json
import re
from pathlib import Path

from fs_fedpa.fs_results import rows

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
