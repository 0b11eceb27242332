"""The per-example outcomes of ``fedpa.records.save_outcomes``, written into a run's folder for per-sentence analyses
and
paired bootstraps (:mod:`research.harness.compare` reads them): which examples of the evaluation file each client
holds (:data:`~fs_fedpa.record.EVAL_SHARDS_FILE`, once, when the data is built) and, per evaluation, whether each
was predicted correctly (:data:`~fs_fedpa.record.OUTCOMES_FILE`, one JSON line per client, round and protocol).
No torch and no FederatedScope import: FS's data is read by duck typing (each client's ``<split>_data``)."""

from __future__ import annotations

import json
import os
from pathlib import Path

from fs_fedpa.record import EVAL_SHARDS_FILE, OUTCOMES_FILE


def eval_shards(data, evaluation: list) -> dict[str, dict[str, list[int]]]:
    """split -> client id -> the indices into ``evaluation`` (the encoded GLUE evaluation file) of that client's
    examples of the split, in order, for every split whose examples all come from ``evaluation``. FS's splitters
    hand the example tuples themselves to the clients, so their identity says where each came from."""
    index = {id(example): i for i, example in enumerate(evaluation)}
    shards: dict[str, dict[str, list[int]]] = {}
    for cid, client in data.items():
        for split in ("train", "val", "test"):
            examples = getattr(client, f"{split}_data", None) or []
            if cid != 0 and examples and all(id(e) in index for e in examples):
                shards.setdefault(split, {})[str(cid)] = [index[id(e)] for e in examples]
    return shards


def write_eval_shards(outdir: str, data, evaluation: list) -> None:
    """``<outdir>/fedpa_eval_shards.json``: ``{"size": len(evaluation), "splits": eval_shards(data, evaluation)}``."""
    path = Path(outdir) / EVAL_SHARDS_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps({"size": len(evaluation), "splits": eval_shards(data, evaluation)}))


def append_outcomes(outdir: str, outcomes: dict[str, dict[str, str]], rnd: int, client: int) -> None:
    """Append one evaluation's ``outcomes`` (protocol -> split -> "0110...") to ``<outdir>/fedpa_outcomes.jsonl``."""
    lines = [
        {"round": rnd, "client": client, "protocol": protocol, "split": split, "correct": bits}
        for protocol, splits in outcomes.items()
        for split, bits in splits.items()
    ]
    with open(os.path.join(outdir, OUTCOMES_FILE), "a", encoding="utf-8") as f:
        f.writelines(json.dumps(line) + "\n" for line in lines)
