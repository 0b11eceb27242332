"""Does this code still compute what the committed SST-2 runs computed? (run from the repo root)

Reruns the final stage's cells FedPA-LoRA, FedIT, FedSA-LoRA, FedDPA-T and FLoRA at seed 0 for 3 rounds through FS,
exactly as the protocol ran them (``selected.json``'s values, one thread, ``eval.freq`` 3), and compares every field
of their evaluations and diagnostics with the first 3 rounds of the committed run files. A change meant to move no
bit (a refactor; a feature that is off) must print ``identical`` for every cell.

    python research/scripts/reproduce_cells.py --data ../shared/data/glue [--jobs 2] [--cells fedpa fedit] [--work DIR]

Exit 0 when every field of every cell is equal, 1 otherwise (each difference is printed: cell, round, field, the
committed and the new value). The committed runs were made with torch 2.13.0+cpu on one thread; another torch
build or CPU kernel (an AVX-512 host against an AVX2 one) can differ from the rounding level on, so run it on the
commit before a change first (the baseline), then after, on the same machine. Where the baseline itself differs
from the committed runs (another CPU), compare the after run with the baseline's FS outputs instead:

    python research/scripts/reproduce_cells.py --data ../shared/data/glue --work exp/after --against exp/baseline
"""

from __future__ import annotations

import argparse
import json
import math
import shutil
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from research.harness import compare  # noqa: E402
from research.study import protocol_results as pr  # noqa: E402
from research.study import sst2_protocol as sp  # noqa: E402

CELLS = ("fedpa", "fedit", "fedsa_lora", "feddpa_t", "flora")
ROUNDS = 3


def runs(cells: list[str]) -> list[sp.Run]:
    selected = json.loads((ROOT / sp.REPORT / "selected.json").read_text())
    chosen = [r for r in sp.final_runs(selected, ROUNDS, seeds=(0,)) if r.name in cells]
    return [sp.Run(r.stage, r.name, r.method, (*r.opts, *sp.ONE_THREAD, "eval.freq", "3"), 0, ROUNDS) for r in chosen]


def differences(old: dict, new: dict, rounds: int = ROUNDS, added: tuple[str, ...] = ()) -> list[tuple]:
    """``(round, field, committed, new)`` for every evaluation metric and diagnostic field of the first ``rounds``
    rounds that is missing on either side or not equal (NaN equals NaN); a diagnostic of ``added`` (one this code
    adds) is not counted where only the new run has it."""
    out = []

    def same(a, b) -> bool:
        if isinstance(a, float) and isinstance(b, float) and math.isnan(a) and math.isnan(b):
            return True
        return a == b

    for r in range(rounds):
        a, b = old["rounds"].get(r, {}), new["rounds"].get(r, {})
        out += [(r, f"eval:{k}", a.get(k), b.get(k)) for k in sorted(set(a) | set(b)) if not same(a.get(k), b.get(k))]
    old_d = [d for d in old.get("diagnostics", []) if d.get("round", 0) < rounds]
    new_d = [d for d in new.get("diagnostics", []) if d.get("round", 0) < rounds]
    if len(old_d) != len(new_d):
        out.append(("-", "diagnostics: records", len(old_d), len(new_d)))
    for a, b in zip(old_d, new_d):
        r = a.get("round")
        keys = sorted(set(a) | set(b) - {k for k in added if k not in a})
        out += [(r, f"diag:{k}", a.get(k), b.get(k)) for k in keys if not same(a.get(k), b.get(k))]
    return out


def reference_runs(folder) -> dict[str, dict]:
    """The results of an earlier call's FS outputs (``folder/<cell>``), keyed as the committed ones are."""
    out = {}
    for cell in CELLS:
        if (Path(folder) / cell).is_dir():
            out[f"final/{cell}_s0"] = compare.collect(Path(folder) / cell)
    if not out:
        raise SystemExit(f"--against {folder}: no cell's FS output in it (an earlier call's --work)")
    return out


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="GLUE folder with SST-2/train.tsv and SST-2/dev.tsv")
    parser.add_argument("--work", default="exp/reproduce_cells", help="FS outputs (deleted and rerun each call)")
    parser.add_argument("--jobs", type=int, default=1, help="FS runs at a time (each on one thread)")
    parser.add_argument("--cells", nargs="+", default=list(CELLS), choices=CELLS)
    parser.add_argument(
        "--against",
        metavar="DIR",
        help="compare with the FS outputs of an earlier call's --work (the baseline on this machine), not the "
        "committed run files",
    )
    parser.add_argument(
        "--added",
        nargs="*",
        default=[],
        metavar="FIELD",
        help="diagnostics this code adds (e.g. change_norm_mean): not counted where only the new run has them",
    )
    args = parser.parse_args(argv)
    work = Path(args.work)
    if args.against and Path(args.against).resolve() == work.resolve():
        parser.error("--against must not be --work: each call deletes and reruns its --work")
    reference = reference_runs(args.against) if args.against else pr.load_results(ROOT / sp.REPORT)
    what = f"the runs in {args.against}" if args.against else "the committed runs"

    def one(run: sp.Run) -> tuple[str, list]:
        out = work / run.name
        if out.exists():
            shutil.rmtree(out)
        compare.run_one(str(sp.CFG), run.cell(), 0, out, ["data.root", args.data], str(ROUNDS))
        return run.name, differences(reference[f"final/{run.name}_s0"], compare.collect(out), added=tuple(args.added))

    failed = 0
    with ThreadPoolExecutor(max_workers=args.jobs) as pool:
        for name, diffs in pool.map(one, runs(args.cells)):
            print(f"{name}: {'identical' if not diffs else f'{len(diffs)} fields differ'}", flush=True)
            for r, field, a, b in diffs[:20]:
                print(f"    round {r} {field}: then {a!r}, now {b!r}")
            failed += bool(diffs)
    print(f"{len(args.cells) - failed} of {len(args.cells)} cells identical to {what}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
