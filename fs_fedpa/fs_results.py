"""Reading FederatedScope's ``eval_results.log`` (one ``str(dict)`` per line; numpy 2 prints ``np.float64(x)``) and
the DP-SGD lines of a run's ``exp_print.log``."""

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


_NOISE_LINE = re.compile(r"client #(\d+): DP-SGD .*?clipped sum ([0-9.eE+-]+) against noise ([0-9.eE+-]+) ")


def read_noise_signal(folder: str | Path) -> dict[str, list[float | None]]:
    """Each DP-SGD client's noise/signal per round in its own log (``{client: [||noise|| / ||clipped sum||, ...]}``
    in round order, 3 significant digits; None where the clipped sum is 0; the line of
    :func:`fs_fedpa.plugin.privacy.signal_noise_text`, which only the client's log holds). Empty without DP-SGD."""
    path, out = Path(folder) / "exp_print.log", {}
    for match in map(_NOISE_LINE.search, path.read_text(errors="replace").splitlines() if path.is_file() else []):
        if match:
            signal, noise = float(match.group(2)), float(match.group(3))
            out.setdefault(match.group(1), []).append(float(f"{noise / signal:.3g}") if signal > 0 else None)
    return out
