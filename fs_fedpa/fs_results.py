"""Reading FederatedScope's ``eval_results.log`` (one ``str(dict)`` per line; numpy 2 prints ``np.float64(x)``)."""

from __future__ import annotations

import ast
import re
from pathlib import Path

_NP_SCALAR = re.compile(r"np\.\w+\(([^()]*)\)")


def weighted_avg_by_round(path: str | Path) -> dict[int, dict]:
    """``round -> Results_weighted_avg`` of every server evaluation in ``path`` (nan becomes None)."""
    rounds = {}
    for line in Path(path).read_text().splitlines():
        try:
            row = ast.literal_eval(_NP_SCALAR.sub(r"\1", line).replace("nan", "None"))
        except (ValueError, SyntaxError):
            continue
        if isinstance(row, dict) and isinstance(row.get("Round"), int) and "Results_weighted_avg" in row:
            rounds[row["Round"]] = row["Results_weighted_avg"]
    return dict(sorted(rounds.items()))
