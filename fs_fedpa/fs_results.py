"""Reading FederatedScope's ``eval_results.log`` (one ``str(dict)`` per line; numpy 2 prints ``np.float64(x)``): the
final metrics ``fs-fedpa run`` prints and the export's README states."""

from __future__ import annotations

import ast
import re
from pathlib import Path

_NP_SCALAR = re.compile(r"np\.\w+\(([^()]*)\)")
ROUND_START = re.compile(r"Starting (?:a new )?training(?: round)? \(Round #(\d+)\)")  # FS's server, round r begins


def rows(path: str | Path):
    """Each line of ``path`` that is a dict with an integer ``Round`` (nan becomes None)."""
    for line in Path(path).read_text().splitlines():
        try:
            row = ast.literal_eval(_NP_SCALAR.sub(r"\1", line).replace("nan", "None"))
        except (ValueError, SyntaxError):
            continue
        if isinstance(row, dict) and isinstance(row.get("Round"), int):
            yield row


def weighted_avg_by_round(path: str | Path) -> dict[int, dict]:
    """``round -> Results_weighted_avg`` of every server evaluation in ``path`` (nan becomes None)."""
    rounds = {row["Round"]: row["Results_weighted_avg"] for row in rows(path) if "Results_weighted_avg" in row}
    return dict(sorted(rounds.items()))


def last_weighted_avg(path: str | Path) -> dict:
    """The last server evaluation's ``Results_weighted_avg`` in ``path``; {} when it holds none."""
    rounds = weighted_avg_by_round(path)
    return rounds[max(rounds)] if rounds else {}

