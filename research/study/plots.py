"""The SST-2 study's own figures, drawn with the comparison's helpers (:mod:`research.harness.plots`).

- ``protocols.png`` (:func:`plot_protocols`): the metric vs round under both evaluation protocols;
- ``staleness.png`` (:func:`plot_staleness`): a returning client's drift from the reference against the rounds it
  sat out (partial participation);
- ``verdict.png`` (:func:`plot_verdict`): the protocol's paired intervals of FedPA-LoRA − baseline, one row per
  setting and baseline, one panel per evaluation protocol.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from research.harness.plots import COLORS, MARKERS, band, by_cell, cell_series, integer_rounds, legend, mean_curve
from research.harness.plots import metric_of, pyplot, save, style


def plot_protocols(runs: Sequence[dict], metric: str, path: Path) -> Path:
    """``metric`` vs round under both evaluation protocols, side by side: the paper protocol (``metric``) and the
    clients' own factors (``local.<metric>``); mean ± std over seeds per cell."""
    plt = pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5), sharey=True)
    for ax, (key, title) in zip(axes, ((metric, "paper protocol"), (f"local.{metric}", "own factors"))):
        for i, (cell, group) in enumerate(by_cell(runs).items()):
            rounds, means, stds = mean_curve(cell_series(group, metric_of(key)))
            if rounds:
                band(ax, rounds, means, stds, f"{cell} ({len(group)})", **style(i))
        integer_rounds(ax)
        ax.set(xlabel="round", title=f"{key}: {title} (mean ± std over seeds)")
        ax.grid(alpha=0.3)
    axes[0].set_ylabel(metric)
    legend(axes[0], fontsize=8)
    return save(fig, path)


def stale_drift(run: dict) -> tuple[list[tuple[float, float]], bool]:
    """A run's ``(staleness, drift_start)`` points and whether they are per client: its ``stale_drift`` pairs
    (every returning client of every round) or, for a run recorded before those were kept, one point per round
    from the round means."""
    diagnostics = run.get("diagnostics", [])
    pairs = [tuple(p) for d in diagnostics for p in d.get("stale_drift", [])]
    if pairs:
        return pairs, True
    means = [(d["staleness_mean"], d["drift_start_mean"]) for d in diagnostics
             if d.get("staleness_mean") is not None and d.get("drift_start_mean") is not None]  # fmt: skip
    return means, False


def plot_staleness(runs: Sequence[dict], path: Path) -> Path:
    """Partial participation: a returning client's drift from the reference at its round's start,
    ``||s_i B_i A_i - X_g,i||_F``, against the rounds it sat out; one colour per cell, all seeds. Filled: one point
    per client and round; hollow: round means (runs recorded before the per-client pairs were kept)."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (cell, group) in enumerate(by_cell(runs).items()):
        for kind in (True, False):
            points = []
            for run in group:
                found, per_client = stale_drift(run)
                points += found if per_client == kind else []
            if points:
                color = COLORS[i % len(COLORS)]
                face = color if kind else "none"
                label = cell + ("" if kind else " (round means)")
                ax.scatter(*zip(*points), s=10 if kind else 18, facecolors=face, edgecolors=color, alpha=0.6,
                           marker=MARKERS[i % len(MARKERS)], label=label)  # fmt: skip
    ax.set(xlabel="rounds since the client last trained", ylabel="drift at round start ‖s_i B_i A_i − X_g,i‖_F",
           title="Does a preserved factor that sat out drift from the reference?", yscale="log")  # fmt: skip
    ax.grid(alpha=0.3)
    legend(ax, fontsize=8)
    return save(fig, path)


VERDICT_COLOURS = {"wins": "#1a9850", "loses": "#d73027", "ties": "#808080"}


def plot_headline(rows: Sequence[dict], path: Path) -> Path:
    """FedPA-LoRA − FedIT, one row a setting (``{"label", "val_acc": {"mean", "low", "high", "verdict", "holm"}}``,
    fractions), in accuracy points on one axis; the paper's protocol; the dot filled where the Holm label holds."""
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7.5, 0.9 + 0.42 * len(rows)))
    for y, row in enumerate(rows):
        r = row["val_acc"]
        colour = VERDICT_COLOURS[r["verdict"]]
        ax.plot([100 * r["low"], 100 * r["high"]], [y, y], color=colour, lw=2.5)
        filled = r["holm"] != "ties"
        ax.plot(100 * r["mean"], y, "o", color=colour, mfc=colour if filled else "white", ms=7)
    ax.axvline(0, color="black", lw=0.8)
    ax.set_yticks(range(len(rows)))
    ax.set_yticklabels([row["label"] for row in rows], fontsize=9)
    ax.invert_yaxis()
    ax.set_xlabel("FedPA-LoRA − FedIT, SST-2 dev accuracy points (95% interval)")
    ax.grid(axis="x", alpha=0.3)
    ax.set_title("Right of 0: FedPA-LoRA better. Red: worse, grey: a tie; filled: holds after Holm", fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=120, bbox_inches="tight")
    plt.close(fig)
    return path


def plot_verdict(rows: Sequence[dict], path: Path) -> Path:
    """One horizontal interval per row (``{"setting", "against", "val_acc": row, "local.val_acc": row}``, each row
    ``{"mean", "low", "high", "verdict", "holm"}`` as fractions), in points; a panel per protocol, zero drawn,
    coloured by the raw verdict, the dot filled where the Holm label is not a tie; settings separated and named."""
    plt = pyplot()
    panels = (("val_acc", "paper protocol (global adapter + local head)"), ("local.val_acc", "own factors"))
    firsts = [i for i, row in enumerate(rows) if i == 0 or row["setting"] != rows[i - 1]["setting"]]
    ys, y, edges = [], 0.0, []
    for i in range(len(rows)):
        if i and i in firsts:  # a gap and a rule between settings
            y += 0.8
            edges.append(y - 0.9)
        ys.append(y)
        y += 1
    height = 1.2 + 0.24 * y
    fig, axes = plt.subplots(1, 2, figsize=(12, height), sharey=True)
    for ax, (metric, title) in zip(axes, panels):
        for yi, row in zip(ys, rows):
            r = row.get(metric)
            if r is None:
                continue
            colour = VERDICT_COLOURS[r["verdict"]]
            ax.plot([100 * r["low"], 100 * r["high"]], [yi, yi], color=colour, lw=2)
            filled = r["holm"] != "ties"  # every row carries its family's Holm label (protocol_results.with_holm)
            ax.plot(100 * r["mean"], yi, "o", color=colour, mfc=colour if filled else "white", ms=6)
        ax.axvline(0, color="black", lw=0.8)
        for edge in edges:
            ax.axhline(edge, color="#cccccc", lw=0.6)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("accuracy points")
        ax.grid(axis="x", alpha=0.3)
    axes[0].set_yticks(ys)
    axes[0].set_yticklabels([str(row["against"]) for row in rows], fontsize=8)
    axes[0].invert_yaxis()
    for i in firsts:
        axes[1].annotate(rows[i]["setting"], xy=(1.02, ys[i]), xycoords=("axes fraction", "data"), fontsize=8,
                         va="center", ha="left", fontweight="bold")  # fmt: skip
    fig.suptitle("FedPA-LoRA − baseline, 95% interval: wins (green), ties (grey), loses (red); filled: survives Holm",
                 fontsize=11)  # fmt: skip
    fig.tight_layout()
    fig.savefig(path, dpi=110, bbox_inches="tight")
    plt.close(fig)
    return path
