"""The comparison's figures (matplotlib, PNG), from the runs :mod:`research.harness.compare` collects.

A run is ``{"cell", "seed", "rounds": {round: FS weighted-average metrics}, "diagnostics": [per-round record]}``,
with ``"curve": [{"round", "minutes", "bytes"}]`` (cumulative at each evaluation) where it wrote a summary.json;
each figure shows the mean over seeds of every cell (a band for the spread where there are several seeds):

- ``accuracy.png``: the metric vs round;
- ``mismatch.png``: E_agg, E_init(B) and E_init(A) vs round for one LoRA module (the paper's Figure 2), on log
  axes where an exact zero (FedPA's E_init) lies on the floor;
- ``spectrum.png``: singular values of the aggregate sum_i w_i B_i A_i of that module, one curve per round;
- ``bytes.png``: the metric vs cumulative uplink + downlink MiB at each evaluation (the summary's curve; the
  diagnostics' ``bytes_total`` for runs from before summary.json, drawn without a band as before);
- ``mechanism.png``: what explains a ranking, per round: the norm of the global update ||sum_i w_i Delta W_i||_F,
  the clients' own ||Delta W_i||_F, their drift from the reference they received (relative), and the ratio of the
  alignment term's gradient to the task loss's gradient at a round's last step (client fields: mean over clients);
- ``minutes.png``: the metric vs cumulative wall minutes at each evaluation (the summary's curve; written only where
  some run has one).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from pathlib import Path


def pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only; never a display
    import matplotlib.pyplot as plt

    return plt


def save(fig, path: Path) -> Path:
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    pyplot().close(fig)
    return path


def legend(ax, **kwargs) -> None:
    """A legend where the axes have labelled lines; an empty panel (no run recorded its field) gets none."""
    if ax.get_legend_handles_labels()[0]:
        ax.legend(**kwargs)


def by_cell(runs: Sequence[dict]) -> dict[str, list[dict]]:
    cells: dict[str, list[dict]] = {}
    for run in runs:
        cells.setdefault(run["cell"], []).append(run)
    return cells


def mean_curve(series: Sequence[dict[int, float]]) -> tuple[list[int], list[float], list[float]]:
    """Rounds present in every seed, with the mean and the sample standard deviation over seeds (0 for one)."""
    common = sorted(set.intersection(*(set(s) for s in series))) if series else []
    means = [statistics.mean(s[r] for s in series) for r in common]
    stds = [statistics.stdev([s[r] for s in series]) if len(series) > 1 else 0.0 for r in common]
    return common, means, stds


def cell_series(runs: Sequence[dict], key) -> list[dict[int, float]]:
    """Per run, ``round -> value`` of ``key(run, round)`` where it is a number."""
    out = []
    for run in runs:
        values = {}
        for rnd, value in key(run):
            if isinstance(value, (int, float)) and math.isfinite(value):
                values[int(rnd)] = float(value)
        out.append(values)
    return out


def metric_of(name: str):
    return lambda run: ((r, m.get(name)) for r, m in run["rounds"].items())


def diag_of(name: str):
    return lambda run: ((d["round"], d.get(name)) for d in run.get("diagnostics", []))


def integer_rounds(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


# matplotlib's ten default colours, then six more, so a full comparison (13+ cells) repeats no colour
COLORS = (*(f"C{i}" for i in range(10)), "black", "gold", "navy", "lime", "maroon", "teal")
MARKERS = "osd^v<>xP*"  # 10 markers x 4 dashes: 20 distinct pairs


def style(i: int) -> dict:
    """Line style of the i-th cell: colour, dash and marker vary, so that overlapping curves stay visible."""
    return {
        "color": COLORS[i % len(COLORS)],
        "linestyle": ("-", "--", "-.", ":")[i % 4],
        "marker": MARKERS[i % len(MARKERS)],
        "markersize": 4,
    }


def band(ax, rounds, means, stds, label, **style):
    (line,) = ax.plot(rounds, means, label=label, **style)
    if any(stds):
        low = [m - s for m, s in zip(means, stds)]
        high = [m + s for m, s in zip(means, stds)]
        ax.fill_between(rounds, low, high, color=line.get_color(), alpha=0.15, linewidth=0)
    return line


def plot_accuracy(runs: Sequence[dict], metric: str, path: Path) -> Path:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (cell, group) in enumerate(by_cell(runs).items()):
        rounds, means, stds = mean_curve(cell_series(group, metric_of(metric)))
        if rounds:
            band(ax, rounds, means, stds, cell, **style(i))
    integer_rounds(ax)
    ax.set(xlabel="round", ylabel=f"{metric} (paper protocol)", title=f"{metric} vs round (mean ± std over seeds)")
    ax.grid(alpha=0.3)
    legend(ax, fontsize=8, ncol=2)
    return save(fig, path)


def plot_mismatch(runs: Sequence[dict], path: Path) -> Path:
    """Figure 2: E_agg and E_init(B), E_init(A) of the probe module vs round; zeros drawn on the floor."""
    plt = pyplot()
    panels = (("e_agg_probe", "E_agg (probe module)"), ("e_init_B", "E_init(B)"), ("e_init_A", "E_init(A)"))
    curves = {}
    for cell, group in by_cell(runs).items():
        for key, _ in panels:
            curves[cell, key] = mean_curve(cell_series(group, diag_of(key)))
    positive = [v for rounds, means, _ in curves.values() for v in means if v > 0]
    floor = min(positive) / 10 if positive else 1e-8
    fig, axes = plt.subplots(1, 3, figsize=(14, 4.2))
    for ax, (key, title) in zip(axes, panels):
        for i, cell in enumerate(by_cell(runs)):
            rounds, means, _ = curves[cell, key]
            if rounds:
                ax.plot(rounds, [max(v, floor) for v in means], label=cell, **style(i))
        ax.set_yscale("log")
        integer_rounds(ax)
        ax.axhline(floor, color="grey", linewidth=0.8, linestyle=":")
        ax.set(xlabel="round", title=title)
        ax.grid(alpha=0.3, which="both")
    axes[0].set_ylabel(f"mean over seeds; exact 0 drawn at the floor {floor:.1e}")
    legend(axes[-1], fontsize=8)
    module = next((d["probe_module"] for r in runs for d in r.get("diagnostics", [])), "?")
    fig.suptitle(f"Aggregation and initialization mismatch, module {module}", fontsize=9)
    return save(fig, path)


def plot_spectrum(runs: Sequence[dict], path: Path) -> Path:
    """Per cell whose server forms the aggregate's spectrum: singular values of the probe module by round
    (the cell's first seed)."""
    plt = pyplot()
    cells = {
        cell: sorted(group, key=lambda r: r["seed"])[0]
        for cell, group in by_cell(runs).items()
        if any(d.get("spectrum_probe") for r in group for d in r.get("diagnostics", []))
    }
    fig, axes = plt.subplots(1, max(len(cells), 1), figsize=(4.5 * max(len(cells), 1), 4), squeeze=False)
    axes = axes[0]
    cmap = plt.get_cmap("viridis")
    for ax, (cell, run) in zip(axes, cells.items()):
        diags = [d for d in run["diagnostics"] if d.get("spectrum_probe")]
        for i, d in enumerate(diags):
            s = d["spectrum_probe"]
            ax.semilogy(range(1, len(s) + 1), s, color=cmap(i / max(len(diags) - 1, 1)), label=f"round {d['round']}")
        ax.set(xlabel="index j", ylabel="σ_j of Σ w_i B_i A_i", title=f"{cell} (seed {run['seed']})")
        ax.grid(alpha=0.3, which="both")
        legend(ax, fontsize=7)
    if not cells:
        axes[0].text(0.5, 0.5, "no run recorded a spectrum", ha="center", va="center")
    return save(fig, path)


def cost_of(cost: str):
    """``(round, cumulative cost at that evaluation)`` of a run: ``minutes`` or ``bytes`` from its summary's curve;
    for runs from before summary.json, no minutes and the diagnostics' ``bytes_total`` of the evaluated round."""
    if cost not in ("minutes", "bytes"):
        raise ValueError(f"cost must be minutes or bytes, got {cost!r}")

    def points(run):
        if run.get("curve"):
            return ((p["round"], p[cost]) for p in run["curve"])
        return diag_of("bytes_total")(run) if cost == "bytes" else iter(())

    return points


def cost_curve(runs: Sequence[dict], metric: str, cost: str) -> tuple[list[float], list[float], list[float]]:
    """At the rounds evaluated in every run that records ``cost``: the mean cost (x), the mean and the sample
    standard deviation of ``metric`` over those runs (the seeds of a cell). Runs without the cost are left out."""
    pairs = [(c, m) for c, m in zip(cell_series(runs, cost_of(cost)), cell_series(runs, metric_of(metric))) if c]
    if not pairs:
        return [], [], []
    cost_rounds, xs, _ = mean_curve([c for c, _ in pairs])
    rounds, means, stds = mean_curve([m for _, m in pairs])
    by_round = dict(zip(cost_rounds, xs))  # evaluated rounds may be a subset of the aggregated ones
    kept = [(by_round[r], m, s) for r, m, s in zip(rounds, means, stds) if r in by_round]
    return [x for x, _, _ in kept], [m for _, m, _ in kept], [s for _, _, s in kept]


COSTS = {  # cost -> (scale of its unit, x label)
    "minutes": (1.0, "cumulative wall time (minutes)"),
    "bytes": (2**-20, "cumulative uplink + downlink (MiB)"),
}


def plot_cost(runs: Sequence[dict], metric: str, cost: str, path: Path) -> Path:
    """The metric at each evaluation vs the wall minutes or the bytes spent up to it, mean ± std over seeds."""
    plt = pyplot()
    scale, xlabel = COSTS[cost]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for i, (cell, group) in enumerate(by_cell(runs).items()):
        xs, means, stds = cost_curve(group, metric, cost)
        if not any(r.get("curve") for r in group):
            stds = [0.0] * len(stds)  # runs from before summary.json: drawn as the committed reports drew them
        if xs:
            band(ax, [x * scale for x in xs], means, stds, cell, **style(i))
    title = "wall time" if cost == "minutes" else "communication"
    ax.set(xlabel=xlabel, ylabel=metric, title=f"{metric} vs {title}")
    ax.grid(alpha=0.3)
    legend(ax, fontsize=8, ncol=2)
    return save(fig, path)


MECHANISM = (
    ("global_update_norm", "||Σ w_i ΔW_i||_F (global update)"),
    ("delta_norm_mean", "||ΔW_i||_F (client update, mean)"),
    ("drift_rel_mean", "||ΔW_i − X_g,i||_F / ||X_g,i||_F (mean)"),
    ("grad_ratio_last_mean", "||∇ alignment|| / ||∇ task||, last step (mean)"),
)


def plot_mechanism(runs: Sequence[dict], path: Path) -> Path:
    """The diagnostics that explain a result, per round, on log axes (mean over seeds; cells without a field are
    left out of its panel, e.g. methods without an alignment term in the gradient-ratio panel)."""
    plt = pyplot()
    fig, axes = plt.subplots(1, len(MECHANISM), figsize=(4.6 * len(MECHANISM), 4.2))
    for ax, (key, title) in zip(axes, MECHANISM):
        for i, (cell, group) in enumerate(by_cell(runs).items()):
            rounds, means, stds = mean_curve(cell_series(group, diag_of(key)))
            if rounds and any(m > 0 for m in means):
                band(ax, rounds, means, stds, cell, **style(i))
        ax.set_yscale("log")
        integer_rounds(ax)
        ax.set(xlabel="round", title=title)
        ax.title.set_fontsize(9)
        ax.grid(alpha=0.3, which="both")
    legend(axes[0], fontsize=7)
    fig.suptitle("Mechanism: update sizes, drift from the reference, and the pull of the alignment term", fontsize=9)
    return save(fig, path)


FIGURES = ("accuracy.png", "mismatch.png", "spectrum.png", "bytes.png", "mechanism.png", "minutes.png")


def plot_all(runs: Sequence[dict], metric: str, out: Path) -> list[Path]:
    """Writes :data:`FIGURES` into ``out`` and returns their paths in that order; ``minutes.png`` only where some
    run has a summary's curve (runs from before summary.json record no wall time per evaluation)."""
    out.mkdir(parents=True, exist_ok=True)
    paths = [
        plot_accuracy(runs, metric, out / "accuracy.png"),
        plot_mismatch(runs, out / "mismatch.png"),
        plot_spectrum(runs, out / "spectrum.png"),
        plot_cost(runs, metric, "bytes", out / "bytes.png"),
        plot_mechanism(runs, out / "mechanism.png"),
    ]
    if any(run.get("curve") for run in runs):
        paths.append(plot_cost(runs, metric, "minutes", out / "minutes.png"))
    return paths
