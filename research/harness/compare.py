"""Run a grid of federated methods x seeds x config overrides through FederatedScope; tabulate and plot it.

    python -m research.harness.compare --cfg yaml_configs/fedpa_sst2_minilm_cpu.yaml --methods fedpa fedit flexlora \\
        [--cell fedpa_lam0 fedpa fedpa.lam 0] --seeds 0 1 2 --out exp/compare_sst2 [--metric val_acc] \\
        [--earlier exp/an_earlier_grid/runs.json] [KEY VALUE ...]

A *cell* is a name, a ``federate.method`` and FS overrides of its own: ``--methods m`` adds the cell ``m`` with
none, ``--cell NAME METHOD [KEY VALUE ...]`` one with overrides (an ablation, another λ, heterogeneous ranks).
Each run is one ``python -m federatedscope.main`` subprocess with ``federate.method``, ``seed``, ``outdir`` and
``expname`` set, so every cell shares the config, the data split (FS seeds it with 12345) and the evaluation
protocol. A finished run (its ``result.json`` exists) is skipped when the command is repeated; the report is
always rebuilt from the runs' files: the run's ``summary.json`` (the metrics of every evaluation with the wall
minutes and bytes spent up to it; FS's ``eval_results.log`` for runs from before summary.json) and the plugin's
``fedpa_diagnostics.jsonl``.

Written to ``--out``: ``results.md`` and ``results.csv`` (mean ± std over seeds of the final and the best round
for the paper protocol ``<metric>`` and the clients' own factors ``local.<metric>``, with E_agg, E_init,
communication and wall minutes), ``runs.json`` (every run's curves and diagnostics) and the figures of
:mod:`research.harness.plots` (among them the metric against wall minutes and against bytes).
"""

from __future__ import annotations

import argparse
import csv
import functools
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from fs_fedpa.files import read_config
from fs_fedpa.fs_results import ROUND_START, weighted_avg_by_round
from fs_fedpa.methods import names as method_names
from fs_fedpa.record import CLIENT_STATS, DIAGNOSTICS_FILE, compact, finite
from fs_fedpa.run_summary import SUMMARY_FILE, read_summary
from research.harness.fs_command import fs_overrides, with_yaml_keys
from research.harness.fs_results import clients_last_round, read_noise_signal, read_outcomes, read_privacy


@dataclass(frozen=True)
class Cell:
    name: str
    method: str
    opts: tuple[str, ...] = field(default=())


def parse_cells(methods: list[str], cells: list[list[str]]) -> list[Cell]:
    """``--methods`` (``all``: every method of :func:`fs_fedpa.methods.names`) and ``--cell`` specs as cells."""
    known = method_names()
    out = [Cell(m, m) for m in (known if methods == ["all"] else methods)]
    for spec in cells:
        if len(spec) < 2 or len(spec) % 2:
            raise SystemExit(f"--cell needs NAME METHOD and KEY VALUE pairs, got {' '.join(spec)!r}")
        out.append(Cell(spec[0], spec[1], tuple(spec[2:])))
    if unknown := sorted({c.method for c in out} - set(known)):
        raise SystemExit(f"unknown federate.method {unknown}; known: {', '.join(known)} (or --methods all)")
    names = [c.name for c in out]
    if len(set(names)) != len(names) or not out:
        raise SystemExit(f"cell names must be unique and at least one is needed, got {names}")
    if bad := [n for n in names if not re.fullmatch(r"[A-Za-z0-9_.+-]+", n)]:
        raise SystemExit(f"cell names become folder names; use letters, digits and _.+- only: {bad}")
    return out


def _option(opts: list[str], key: str) -> str | None:
    return dict(zip(opts[::2], opts[1::2])).get(key)


def _rounds_in(cfg: str) -> str | None:
    """``federate.total_round_num`` of the yaml, for the progress lines (None if it cannot be read)."""
    try:
        import yaml

        return str(yaml.safe_load(Path(cfg).read_text())["federate"]["total_round_num"])
    except Exception:
        return None


def _reap(proc: subprocess.Popen) -> float | None:
    """Waits for ``proc`` and returns the CPU seconds (user + system) it and its children used, None where the OS
    does not say; unlike wall time, this does not grow when other work shares the CPUs."""
    if not hasattr(os, "wait4"):
        proc.wait()
        return None
    _, status, usage = os.wait4(proc.pid, 0)
    proc.returncode = os.waitstatus_to_exitcode(status)
    return usage.ru_utime + usage.ru_stime


def run_one(cfg: str, cell: Cell, seed: int, out: Path, opts: list[str], total_rounds: str | None) -> float | None:
    """One FS run in ``out`` (skipped if it finished before); returns its wall time, None if skipped."""
    if (out / "result.json").is_file():
        return None
    out.mkdir(parents=True, exist_ok=True)
    shutil.rmtree(out / "run", ignore_errors=True)  # left by a killed run; FS would nest a sub_exp_* beside it
    fs_opts = ["federate.method", cell.method, "seed", str(seed), "outdir", str(out), "expname", "run"]
    no_checkpoint = ["federate.save_to", "", "fedpa.store.checkpoint", "False"]  # the runner keeps results, not models
    full = ["fedpa.records.diagnostics", "full"]  # the comparison's report reads E_agg, drift and the rest
    cfg, given = with_yaml_keys(cfg, [*no_checkpoint, *full, *opts, *cell.opts, *fs_opts], out)
    cmd = [sys.executable, "-m", "federatedscope.main", "--cfg", cfg, *fs_overrides(given)]
    commit = code_commit()  # the code the run imports now; the checkout may move on while it trains
    start = time.time()
    with (
        open(out / "fs.log", "w") as log,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        for line in proc.stdout:
            log.write(line)
            if match := ROUND_START.search(line):
                total = f"/{total_rounds}" if total_rounds else ""
                done = int(match.group(1)) + 1
                print(f"    {cell.name} seed {seed}: round {done}{total} ({time.time() - start:.0f} s)", flush=True)
        cpu = _reap(proc)
    if proc.returncode != 0:
        raise RuntimeError(f"{cell.name} seed {seed} failed (exit {proc.returncode}); see {out / 'fs.log'}")
    seconds = round(time.time() - start, 1)
    result = {"cell": cell.name, "method": cell.method, "opts": list(cell.opts), "seed": seed, "seconds": seconds}
    if cpu is not None:
        result["cpu_seconds"] = round(cpu, 1)
    result["torch"] = _version("torch")  # the thread count and the torch build change results at the rounding level
    result["commit"] = commit
    result["host"] = host_record()
    (out / "result.json").write_text(json.dumps(result))
    return seconds


# A fixed one-thread workload (50 float32 matmuls of MiniLM's feed-forward shape) timed in CPU seconds: runs whose
# hosts differ in speed differ in CPU time for the same work (docs/study/sst2_protocol.md), and this says by how much.
_PROBE = (
    "import time, torch\n"
    "torch.set_num_threads(1)\n"
    "g = torch.Generator().manual_seed(0)\n"
    "x, w = torch.randn(640, 384, generator=g), torch.randn(384, 1536, generator=g)\n"
    "x @ w\n"
    "start = time.process_time()\n"
    "for _ in range(50):\n"
    "    x @ w\n"
    "print(time.process_time() - start)\n"
)


@functools.lru_cache(maxsize=1)
def host_record() -> dict:
    """This machine, for comparing CPU times across hosts: ``cpu`` (the model /proc/cpuinfo names), ``cpus`` and
    ``probe_cpu_seconds``, the CPU time of :data:`_PROBE` (measured once per process; None where it fails)."""
    cpu = None
    try:
        cpu = next((line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name")), None)  # fmt: skip
    except OSError:
        pass
    probe = None
    try:
        done = subprocess.run([sys.executable, "-c", _PROBE], capture_output=True, text=True, timeout=300)
        probe = round(float(done.stdout.strip()), 3) if done.returncode == 0 else None
    except (OSError, subprocess.SubprocessError, ValueError):
        pass
    return {"cpu": cpu or platform.processor() or None, "cpus": os.cpu_count(), "probe_cpu_seconds": probe}


def code_commit() -> str | None:
    """The git commit of the checkout this ``fs_fedpa`` was imported from (the code a run ran), with ``+dirty``
    where tracked files differ from it; None for an installed copy outside a git checkout."""
    import fs_fedpa
    from fs_fedpa.run_summary import code_commit as commit_of

    return commit_of(fs_fedpa.__file__)


def split_seed(folder: Path) -> int | None:
    """The seed of a finished run's client split, from the config FS saved in ``folder``: its
    ``data.glue_split_seed``, or FS's fixed :data:`~fs_fedpa.tasks.glue.FS_SPLIT_SEED` where that is -1 or absent;
    None where the config cannot be read."""
    import yaml

    from fs_fedpa.tasks.glue import FS_SPLIT_SEED

    try:
        cfg = yaml.safe_load((folder / "config.yaml").read_text())
        seed = cfg.get("data", {}).get("glue_split_seed", -1)
    except (OSError, yaml.YAMLError, AttributeError):
        return None
    return FS_SPLIT_SEED if seed in (-1, None) else int(seed)


def _version(package: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(package)
    except PackageNotFoundError:
        return None


def _mean(values) -> float | None:
    values = [v for v in values if isinstance(v, (int, float))]
    return statistics.mean(values) if values else None


def collect(out: Path) -> dict:
    """A finished run: its ``result.json`` plus per-round metrics and compact diagnostics read from its files.

    ``rounds``: ``{round: metrics}``, the paper protocol's keys as they are and the clients' own as ``local.<key>``,
    from the run's ``summary.json`` (then also ``curve``: ``[{"round", "minutes", "bytes"}]`` cumulative at each
    evaluation, and ``wall_minutes``), or from FS's ``eval_results.log`` for runs from before summary.json."""
    run = json.loads((out / "result.json").read_text())
    run.setdefault("cell", run.get("method"))
    run["split_seed"] = split_seed(out / "run")
    log = out / "run" / "eval_results.log"
    if (summary := read_summary(out / "run")) is not None:
        run.update(from_summary(summary, out / "run" / SUMMARY_FILE))
    else:
        run["rounds"] = {int(r): m for r, m in weighted_avg_by_round(log).items()}
    if log.is_file() and (clients := clients_last_round(log)):
        run["clients"] = clients
    path = out / "run" / DIAGNOSTICS_FILE
    lines = path.read_text().splitlines() if path.is_file() else []
    run["diagnostics"] = [compact(json.loads(line)) for line in lines]
    if (outcomes := read_outcomes(out / "run")) is not None:
        run["outcomes"] = outcomes
    if (privacy := read_privacy(out / "run")) is not None:
        run["privacy"] = privacy
    if noise := read_noise_signal(out / "run"):
        run["noise_signal"] = noise
    return run


def from_summary(summary: dict, path: Path) -> dict:
    """``rounds``, ``curve`` and ``wall_minutes`` of a run from its summary (``path`` names it in errors); NaN
    becomes None, as :func:`~fs_fedpa.fs_results.weighted_avg_by_round` reads it from FS's log."""
    rounds, curve = {}, []
    try:
        for point in summary["curve"]:
            metrics = finite({**point["global"], **{f"local.{k}": v for k, v in point["own"].items()}})
            rounds[int(point["round"])] = metrics
            curve.append({"round": int(point["round"]), "minutes": point["minutes"], "bytes": point["bytes"]})
    except (KeyError, TypeError, AttributeError, ValueError) as exc:
        raise ValueError(f"{path}: curve entries need round, minutes, bytes, global and own ({exc!r})") from None
    return {"rounds": dict(sorted(rounds.items())), "curve": curve, "wall_minutes": summary.get("wall_minutes")}


def _stat(values: list[float]) -> tuple[float, float] | None:
    """(mean, sample standard deviation) over seeds; the deviation of a single seed is 0."""
    if not values:
        return None
    return statistics.mean(values), statistics.stdev(values) if len(values) > 1 else 0.0


def summarize(runs: list[dict], metric: str, larger_is_better: bool) -> list[dict]:
    """Per cell: mean and std over seeds of the final and best ``metric`` / ``local.metric``, of E_agg (relative)
    and E_init averaged over rounds, of the total bytes and of the wall time (the summary's, else the runner's)."""
    rows = []
    for cell in dict.fromkeys(r["cell"] for r in runs):
        group = [r for r in runs if r["cell"] == cell]
        row = {"cell": cell, "method": group[0]["method"], "seeds": len(group)}
        for key in (metric, f"local.{metric}"):
            series = [[m[key] for _, m in sorted(r["rounds"].items()) if m.get(key) is not None] for r in group]
            series = [s for s in series if s]
            row[f"{key} final"] = _stat([s[-1] for s in series])
            row[f"{key} best"] = _stat([max(s) if larger_is_better else min(s) for s in series])
        for key in MEAN_OVER_ROUNDS:
            row[key] = _stat([v for r in group if (v := _mean(d.get(key) for d in r["diagnostics"])) is not None])
        row["MiB"] = _stat([r["diagnostics"][-1]["bytes_total"] / 2**20 for r in group if r["diagnostics"]])
        minutes = [r.get("wall_minutes") or (r.get("seconds") or 0) / 60 for r in group]
        row["minutes"] = _stat([m for m in minutes if m])
        rows.append(row)
    return rows


# Diagnostics tabulated as their mean over rounds (per run; then mean ± std over seeds).
MEAN_OVER_ROUNDS = (
    "e_agg_rel",
    "e_init_B",
    "e_init_A",
    "global_update_norm",
    *(f"{k}_mean" for k in CLIENT_STATS if k not in ("grad_ratio_first", "change_norm")),
)


def columns(metric: str) -> list[str]:
    return [
        *(f"{k} {s}" for k in (metric, f"local.{metric}") for s in ("final", "best")),
        *MEAN_OVER_ROUNDS,
        "MiB",
        "minutes",
    ]


def _fmt(v: tuple[float, float] | None, column: str) -> str:
    if v is None:
        return "–"
    if column in MEAN_OVER_ROUNDS:
        return f"{v[0]:.2e} ± {v[1]:.1e}"
    digits = 1 if column in ("MiB", "minutes") else 4
    return f"{v[0]:.{digits}f} ± {v[1]:.{digits}f}"


SPARSE = ("staleness_mean", "drift_start_mean")  # partial participation only: shown where some run has them


def write_table(rows: list[dict], metric: str, out: Path, protocol_note: str) -> str:
    cols = [c for c in columns(metric) if c not in SPARSE or any(r.get(c) is not None for r in rows)]
    lines = [f"| cell | method | seeds | {' | '.join(cols)} |", "|---|---|---|" + "---|" * len(cols)]
    lines += [
        f"| {r['cell']} | {r['method']} | {r['seeds']} | " + " | ".join(_fmt(r[c], c) for c in cols) + " |"
        for r in rows
    ]
    text = protocol_note + "\n\n" + "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["cell", "method", "seeds", *[f"{c} {p}" for c in cols for p in ("mean", "std")]])
        for r in rows:
            writer.writerow([r["cell"], r["method"], r["seeds"], *[x for c in cols for x in (r[c] or ("", ""))]])
    return text


def protocol_note(metric: str, cfg: str, cells: list[Cell], seeds: list[int], opts: list[str]) -> str:
    overrides = "; ".join(f"`{c.name}`: {' '.join(c.opts)}" for c in cells if c.opts)
    return "\n".join(
        [
            f"Config `{cfg}`{' with ' + ' '.join(opts) if opts else ''}; seeds {seeds}; mean ± sample std over seeds.",
            f"- `{metric}` (paper protocol): each client evaluates on its own dev shard, FedPA-style methods with "
            f"the global reference product plus the client's local tensors, the others with the model they hold "
            f"after the round; weighted by shard size.",
            f"- `local.{metric}`: each client's own factors as it last trained them (those it continues from, for "
            f"methods that keep factors); – where `fedpa.eval.local` is off.",
            "- `e_agg_rel`: ||B_g A_g - sum_i w_i B_i A_i||_F / ||sum_i w_i B_i A_i||_F over all LoRA modules, "
            "mean over rounds; `e_init_B`, `e_init_A`: relative change of a client's factor between the end of a "
            "round and the start of the next (§3.3), first LoRA module, mean over clients and rounds.",
            "- The mechanism, mean over rounds (client fields: mean over clients first): `global_update_norm` "
            "||sum_i w_i Delta W_i||_F; `delta_norm_mean` ||Delta W_i||_F; `drift_mean` ||Delta W_i - X_g,i||_F "
            "from the reference received, `drift_rel_mean` the same over ||X_g,i||_F; `grad_ratio_last_mean` "
            "||grad alignment|| / ||grad task|| at a round's last step (– for methods without an alignment term).",
            "- `MiB`: uplink + downlink payloads of the whole run; `minutes`: wall time of one run (its "
            "summary.json's where it wrote one).",
            *([f"- Cell overrides: {overrides}."] if overrides else []),
        ]
    )


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m research.harness.compare", description=__doc__.splitlines()[0])
    parser.add_argument("--cfg", required=True, help="the FS yaml every run shares")
    parser.add_argument(
        "--methods",
        nargs="*",
        default=[],
        help=f"federate.method values, each a cell, or all: {', '.join(method_names())}",
    )
    parser.add_argument(
        "--cell", nargs="+", action="append", default=[], metavar="ARG", help="NAME METHOD [KEY VALUE ...]"
    )
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--out", required=True, help="folder of the runs, the table and the plots")
    parser.add_argument("--metric", default="val_acc", help="FS metric to tabulate (e.g. val_acc, val_avg_loss)")
    parser.add_argument("--no-plots", action="store_true", help="write the table only")
    parser.add_argument(
        "--earlier",
        metavar="RUNS_JSON",
        help="the runs.json of an earlier grid with the same config: its runs join the table and figures first "
        "(a cell and seed run here replaces the earlier one)",
    )
    parser.add_argument("opts", nargs="*", help="FS overrides for every run, KEY VALUE ...")
    args = parser.parse_args(argv)
    try:
        read_config(args.cfg)  # before any run starts: FS would fail on it in every run, naming neither
    except ValueError as exc:
        parser.exit(2, f"{parser.prog}: error: {exc}\n")
    if len(args.opts) % 2:
        raise SystemExit(f"overrides come in KEY VALUE pairs, got {args.opts}")
    cells = parse_cells(args.methods, args.cell)
    out = Path(args.out)
    larger = not args.metric.endswith("loss")
    grid = [(c, s) for s in args.seeds for c in cells]  # seed-major: every cell has a result early
    times: list[float] = []
    for i, (cell, seed) in enumerate(grid, start=1):
        rounds = (
            _option(list(cell.opts), "federate.total_round_num")
            or _option(args.opts, "federate.total_round_num")
            or _rounds_in(args.cfg)
        )
        eta = f", about {statistics.mean(times) * (len(grid) - i + 1) / 60:.0f} min left" if times else ""
        print(f"[{i}/{len(grid)}] {cell.name}, seed {seed}{eta}", flush=True)
        try:
            seconds = run_one(args.cfg, cell, seed, out / "runs" / f"{cell.name}_s{seed}", args.opts, rounds)
        except RuntimeError as exc:  # a run FS ended: its log holds the cause
            parser.exit(1, f"{parser.prog}: error: {exc}\n")
        if seconds is None:
            print("    finished before; skipped", flush=True)
        else:
            times.append(seconds)
    try:
        runs = [collect(out / "runs" / f"{c.name}_s{s}") for c, s in grid]
    except ValueError as exc:  # a run file that is not what its name says
        parser.exit(1, f"{parser.prog}: error: {exc}\n")
    note = protocol_note(args.metric, args.cfg, cells, args.seeds, args.opts)
    if args.earlier:
        earlier = json.loads(Path(args.earlier).read_text())
        new = {(r["cell"], r["seed"]) for r in runs}
        kept = [r for r in earlier if (r["cell"], r["seed"]) not in new]
        for r in kept:
            r["rounds"] = {int(k): m for k, m in r["rounds"].items()}
        runs = kept + runs
        cells_before = ", ".join(dict.fromkeys(r["cell"] for r in kept))
        note += f"\n- Earlier runs from `{args.earlier}` (an older version of fs_fedpa): {cells_before}."
    (out / "runs.json").write_text(json.dumps(runs))
    print(write_table(summarize(runs, args.metric, larger), args.metric, out, note))
    if not args.no_plots:
        from research.harness.plots import plot_all

        for path in plot_all(runs, args.metric, out):
            print(f"wrote {path}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
