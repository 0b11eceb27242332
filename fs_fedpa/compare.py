"""Run a grid of federated methods x seeds through FederatedScope and tabulate them side by side.

    python -m fs_fedpa.compare --cfg yaml_configs/fedpa_sst2_minilm_cpu.yaml --methods fedpa fedit flexlora \\
        --seeds 0 1 2 --out exp/compare_sst2 [--metric val_acc] [KEY VALUE ...]

Each run is one ``python -m federatedscope.main`` subprocess with ``federate.method``, ``seed``, ``outdir`` and
``expname`` set, so every method shares the config, the data split (FS seeds it with 12345) and the evaluation
protocol. A run that finished (its ``result.json`` exists) is skipped when the command is repeated. The table
(``results.md``, ``results.csv``) gives mean +- std over seeds of the final and the best round, for the paper
protocol (``<metric>``) and the clients' own factors (``local.<metric>``, FedPA-style methods only).
"""

from __future__ import annotations

import argparse
import csv
import json
import re
import statistics
import subprocess
import sys
import time
from pathlib import Path

from fs_fedpa.tools.fs_results import weighted_avg_by_round


def run_one(cfg: str, method: str, seed: int, out: Path, opts: list[str], total_rounds: int | None) -> dict:
    """One FS run in ``out``; returns (and stores) its per-round weighted-average metrics."""
    done = out / "result.json"
    if done.is_file():
        return json.loads(done.read_text())
    out.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "federatedscope.main",
        "--cfg",
        cfg,
        "federate.method",
        method,
        "seed",
        str(seed),
        "outdir",
        str(out),
        "expname",
        "run",
        "federate.save_to",
        "",
        *opts,
    ]
    start = time.time()
    with (
        open(out / "fs.log", "w") as log,
        subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) as proc,
    ):
        for line in proc.stdout:
            log.write(line)
            if match := re.search(r"Starting (?:a new )?training(?: round)? \(Round #(\d+)\)", line):
                total = f"/{total_rounds}" if total_rounds else ""
                print(
                    f"    {method} seed {seed}: round {int(match.group(1)) + 1}{total} ({time.time() - start:.0f} s)",
                    flush=True,
                )
    if proc.returncode != 0:
        raise RuntimeError(f"{method} seed {seed} failed (exit {proc.returncode}); see {out / 'fs.log'}")
    rounds = weighted_avg_by_round(out / "run" / "eval_results.log")
    result = {
        "method": method,
        "seed": seed,
        "rounds": {str(r): m for r, m in rounds.items()},
        "seconds": round(time.time() - start, 1),
    }
    done.write_text(json.dumps(result))
    return result


def summarize(results: list[dict], metric: str, larger_is_better: bool) -> list[dict]:
    """Per method: mean and std over seeds of the final and the best round of ``metric`` and ``local.metric``."""
    rows = []
    for method in dict.fromkeys(r["method"] for r in results):
        row = {"method": method, "seeds": 0}
        for key in (metric, f"local.{metric}"):
            finals, bests = [], []
            for r in results:
                series = [m[key] for m in r["rounds"].values() if r["method"] == method and m.get(key) is not None]
                if series:
                    finals.append(series[-1])
                    bests.append(max(series) if larger_is_better else min(series))
            row["seeds"] = max(row["seeds"], len(finals))
            for name, values in (("final", finals), ("best", bests)):
                row[f"{key} {name}"] = (statistics.mean(values), statistics.pstdev(values)) if values else None
        rows.append(row)
    return rows


def write_table(rows: list[dict], metric: str, out: Path, protocol_note: str) -> str:
    columns = [f"{k} {s}" for k in (metric, f"local.{metric}") for s in ("final", "best")]
    fmt = lambda v: "–" if v is None else f"{v[0]:.4f} ± {v[1]:.4f}"  # noqa: E731
    lines = [f"| method | seeds | {' | '.join(columns)} |", "|---|---|" + "---|" * len(columns)]
    lines += [f"| {r['method']} | {r['seeds']} | " + " | ".join(fmt(r[c]) for c in columns) + " |" for r in rows]
    text = protocol_note + "\n\n" + "\n".join(lines) + "\n"
    (out / "results.md").write_text(text)
    with open(out / "results.csv", "w", newline="") as f:
        writer = csv.writer(f)
        writer.writerow(["method", "seeds", *[f"{c} {p}" for c in columns for p in ("mean", "std")]])
        for r in rows:
            writer.writerow([r["method"], r["seeds"], *[x for c in columns for x in (r[c] or ("", ""))]])
    return text


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cfg", required=True, help="the FS yaml every run shares")
    parser.add_argument("--methods", nargs="+", required=True, help="federate.method values")
    parser.add_argument("--seeds", nargs="+", type=int, default=[0])
    parser.add_argument("--out", required=True, help="folder of the runs and the table")
    parser.add_argument("--metric", default="val_acc", help="FS metric to tabulate (e.g. val_acc, val_avg_loss)")
    parser.add_argument("opts", nargs="*", help="FS overrides for every run, KEY VALUE ...")
    args = parser.parse_args(argv)
    out = Path(args.out)
    larger = not args.metric.endswith("loss")
    rounds = None
    if "federate.total_round_num" in args.opts:
        rounds = int(args.opts[args.opts.index("federate.total_round_num") + 1])
    grid = [(m, s) for m in args.methods for s in args.seeds]
    results = []
    for i, (method, seed) in enumerate(grid, start=1):
        print(f"[{i}/{len(grid)}] {method}, seed {seed}", flush=True)
        results.append(run_one(args.cfg, method, seed, out / "runs" / f"{method}_s{seed}", args.opts, rounds))
    note = (
        f"`{args.metric}`: paper protocol (global reference product + each client's local tensors, on its own "
        f"shard); `local.{args.metric}`: each client's own factors. Weighted over clients; mean ± std over seeds "
        f"{args.seeds}; config `{args.cfg}` {' '.join(args.opts)}."
    )
    print(write_table(summarize(results, args.metric, larger), args.metric, out, note))
    return 0


if __name__ == "__main__":
    sys.exit(main())
