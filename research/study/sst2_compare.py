"""The tuned comparison protocol on real SST-2 with the embedded MiniLM (docs/study/sst2_protocol.md).

    ./run.sh compare --data <GLUE dir>            # or: python -m research.study.sst2_compare --data <GLUE dir>
    ./run.sh compare --plan                       # the stages, their runs and the expected CPU time; writes nothing
    ./run.sh compare --report-only                # rebuild the report from the committed results, nothing else
    ./run.sh compare --data <GLUE dir> --stage partial --jobs 12 use_gpu True device 0   # one stage, on a GPU host

The protocol itself (its stages, runs and plan) is :mod:`research.study.sst2_protocol`; the report is
:mod:`research.study.report`. This module runs the plan: FS subprocesses, ``jobs`` at a time, each
finished run written to its committed file at once; a stopped grid continues where it stopped. ``--plan`` and
``--report-only`` import neither FederatedScope nor torch (``./run.sh`` runs them without installing anything).
"""

from __future__ import annotations

import argparse
import atexit
import fnmatch
import importlib.util
import json
import os
import shutil
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor, as_completed
from pathlib import Path

from fs_fedpa.tools import cli
from research.harness import compare
from research.study import sst2_dp_fedpa, sst2_dp_regime, sst2_dp_valid, sst2_privacy
from research.study import sst2_protocol as sp
from research.study.protocol_results import RUNNER_FIELDS, load_results, time_spent, write_run
from research.study.report import write_report
from research.study.sst2_protocol import (
    CFG,
    CFG_NAME,
    PILOT_ROUNDS,
    REPORT,
    STAGES,
    WORK,
    Run,
    pilot_run,
    pilot_T,
    seconds_per_round,
    whole_rounds,
)
from research.tools.sst2_demo import find_glue_dir


def recollect(results: dict, report: Path, work: Path, stages: list[str]) -> list[str]:
    """Rewrite the committed runs of ``stages`` from their FS outputs under ``work`` with this code's
    :func:`compare.collect`, e.g. after :func:`fs_fedpa.record.compact` learnt to keep another diagnostic. A run
    whose outputs are not on this machine is left as committed; one whose outputs disagree with its committed curve
    (another run's folder) is refused. Returns the keys rewritten."""
    done = []
    for key, old in results.items():
        stage, name = key.split("/", 1)
        out = work / stage / name
        if stage not in stages or not (out / "result.json").is_file():
            continue
        new = compare.collect(out)
        if (new["cell"], new["seed"], new["rounds"]) != (old["cell"], old["seed"], old["rounds"]):
            raise ValueError(f"{out} holds another run than the committed {key}: its cell, seed or curve differ")
        new.update({k: old[k] for k in RUNNER_FIELDS if k in old})
        results[key] = write_run(report, key, new)
        done.append(key)
    return done


def execute(
    runs: list[Run], results: dict, report: Path, work: Path, glue: Path, budget: dict, jobs: int = 1, fs_opts=()
) -> int:
    """Run what has no committed result yet, ``jobs`` FS processes at a time, writing each run's JSON as soon as it
    finishes; a run that fails is reported and retried at the next call. ``fs_opts``: FS overrides for every run
    of this call (e.g. ``use_gpu True device 0`` on a GPU host; recorded in the run's JSON). Once the clock passes
    ``budget["stop_at"]`` (0: no limit) no further run starts; those under way finish and are kept, and a
    ``TimeoutError`` says how many wait for the next call. Returns how many runs finished."""
    pending = [r for r in runs if r.key not in results]
    spent = []

    def one(i: int, run: Run) -> tuple[Run, dict] | None:
        if spent or (budget["stop_at"] and time.time() > budget["stop_at"]):
            spent.append(run)  # decided where the run would start, so a queued run never slips past the budget
            return None
        left = minutes_left(pending[i - 1 :], results)
        print(f"[{run.stage} {i}/{len(pending)}] {run.name} seed {run.seed}, {run.rounds} rounds; "
              f"about {left:.0f} min left in this stage", flush=True)  # fmt: skip
        out = work / run.stage / f"{run.name}_s{run.seed}"
        if (out / "result.json").is_file():  # e.g. a run file deleted to redo the run, its FS outputs still here
            print(f"    {out} holds a finished FS run: its outputs are taken, not rerun (delete that folder to redo "
                  "the run)", flush=True)  # fmt: skip
        try:
            compare.run_one(str(CFG), run.cell(), run.seed, out, ["data.root", str(glue), *fs_opts], str(run.rounds))
        except RuntimeError as failure:
            print(f"    FAILED, left for the next call: {failure}", flush=True)
            return None
        result = compare.collect(out)
        result.update(stage=run.stage, rounds_planned=run.rounds, fs_opts=list(fs_opts), jobs=jobs)
        return run, write_run(report, run.key, result)

    finished = 0
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        for future in as_completed([pool.submit(one, i, run) for i, run in enumerate(pending, start=1)]):
            if (done := future.result()) is None:  # failed or not started: left for the next call
                continue
            run, result = done
            results[run.key] = result
            finished += 1
            budget["ran"] += result["seconds"]
    if spent:
        raise TimeoutError(f"--hours spent; {len(pending) - finished} runs of this stage left")
    return finished


def with_threads(fs_opts: list[str], jobs: int, cpus: int) -> list[str]:
    """``fs_opts`` plus ``fedpa.num_threads`` = cpus // jobs (at least 1) when several jobs share the CPUs and the
    user set no thread count: one MiniLM step of 16 sentences scales poorly over threads (0.34 s on 2 threads,
    0.49 s on 1 here), so two 1-thread runs side by side do 1.4x the work of one 2-thread run."""
    if jobs == 1 or "fedpa.num_threads" in fs_opts[::2]:
        return list(fs_opts)
    return [*fs_opts, "fedpa.num_threads", str(max(1, cpus // jobs))]


def build_parser() -> argparse.ArgumentParser:
    parser = cli.Parser(description=__doc__.splitlines()[0], allow_abbrev=False)  # run.sh matches flags
    parser.add_argument("--data", help="GLUE folder (or set FS_FEDPA_DATA)")
    parser.add_argument("--report", help=f"committed results, selection and report (default: {REPORT}, in a checkout)")
    parser.add_argument("--work", default=str(WORK), help="FS's outputs of every run (not committed)")
    parser.add_argument("--plan", action="store_true", help="print the stages and the expected time; write nothing")
    parser.add_argument("--report-only", action="store_true", help="rebuild the report from the committed results")
    parser.add_argument(
        "--recollect",
        nargs="+",
        metavar="STAGE",
        help="rewrite these stages' committed runs from their FS outputs in --work (this machine's), then go on",
    )
    parser.add_argument(
        "--stage",
        action="append",
        dest="stages",
        metavar="STAGE",
        help="run only this stage's runs (repeat for several), e.g. on a GPU host while this machine runs the others; "
        "a stage still waits for the committed results it depends on",
    )
    parser.add_argument(
        "--cell",
        action="append",
        dest="cells",
        metavar="PATTERN",
        help="run only the cells whose name matches this shell pattern (repeat for several, e.g. --cell 'partial30_*' "
        "--cell fedit_dp), to share a stage between hosts; the other cells' results are still read from --report",
    )
    parser.add_argument("--hours", type=cli.number(minimum=0), default=0.0,
                        help="stop after the run that ends past this many hours")
    parser.add_argument(
        "--jobs",
        type=int,
        default=1,
        help="FS runs at a time; each gets cpus/jobs threads unless fedpa.num_threads is given",
    )
    parser.add_argument(
        "fs_opts",
        nargs="*",
        help="FS overrides for every run of this call, KEY VALUE ... (e.g. use_gpu True device 0)",
    )
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if args.jobs < 1 or len(args.fs_opts) % 2:
        sys.exit(f"--jobs must be >= 1 and FS overrides come in KEY VALUE pairs; got {args.jobs}, {args.fs_opts}")
    if args.plan and args.recollect:
        sys.exit("--plan writes nothing, and --recollect rewrites committed runs: give one of them")
    if args.report is None and (why := not_a_checkout(Path.cwd())):
        sys.exit(why)
    report, work = Path(args.report or REPORT), Path(args.work)
    if args.stages and not set(args.stages) <= set(STAGES):
        sys.exit(f"--stage: unknown {sorted(set(args.stages) - set(STAGES))}; the stages are {' '.join(STAGES)}")

    def wanted(run: Run) -> bool:
        cell = not args.cells or any(fnmatch.fnmatchcase(run.name, p) for p in args.cells)
        return cell and (not args.stages or run.stage in args.stages)

    scoped = bool(args.stages or args.cells)
    if args.plan:
        results = load_results(report)
        print_plan(only(plan_only(results, report), wanted), results, scoped)
        return 0
    if missing := [m for m in ("numpy", "scipy") if importlib.util.find_spec(m) is None]:
        sys.exit(f"the report's intervals need {' and '.join(missing)}, which this Python lacks (pip install "
                 f"{' '.join(missing)}); nothing was written")  # fmt: skip
    if importlib.util.find_spec("matplotlib") is None:
        print("[sst2_compare] matplotlib is not importable: the report's figures are left as they are", flush=True)
    if not args.report_only and not CFG.is_file():
        sys.exit(f"{CFG} not found: run this from a checkout of fs_fedpa (the config lives in yaml_configs/)")
    args.fs_opts = with_threads(args.fs_opts, args.jobs, os.cpu_count() or 1)
    results = load_results(report)
    if args.recollect:
        rewritten = recollect(results, report, work, args.recollect)
        print(f"[sst2_compare] recollected {len(rewritten)} runs from {work}: {' '.join(rewritten) or 'none'}")
    print_plan(only(plan(results, report), wanted), results, scoped)
    if not args.report_only:
        glue = find_glue_dir(args.data)
        claim_work(work)
        budget = {"ran": 0.0, "stop_at": time.time() + args.hours * 3600 if args.hours else 0.0}
        try:
            while True:
                stages = plan(results, report)
                todo = [r for _, runs in stages for r in runs if r.key not in results and wanted(r)]
                # every run the plan has decided in the first stage with one pending, all parts together, so a
                # part of one run does not hold the other job slots; a part its results unlock joins at the next pass
                todo = [r for r in todo if r.stage == todo[0].stage]
                if not todo or not execute(todo, results, report, work, glue, budget, args.jobs, args.fs_opts):
                    break  # done, or every run left in the stage failed: see their fs.log
        except TimeoutError as stop:
            print(f"[sst2_compare] stopping: {stop}; rerun to continue", flush=True)
        print(f"[sst2_compare] this call ran {budget['ran'] / 3600:.2f} h of FS runs", flush=True)
    print(f"wrote {write_report(report, results, plan(results, report))}")
    return 0


def plan(results: dict, report: Path) -> list[tuple[str, list[Run]]]:
    """The protocol's stages as far as the committed results decide them (:func:`research.study.sst2_protocol.plan`),
    then, once the main selection exists, the ``privacy`` stage's parts (:mod:`research.study.sst2_privacy`), the
    ``dpregime`` stage's (:mod:`research.study.sst2_dp_regime`), the ``dpvalid`` stage's and the ``dpfedpa`` stage's.
    """
    stages = sp.plan(results, report)
    selected = report / "selected.json"
    if any(part == "client splits" for part, _ in stages) and selected.is_file():
        main = json.loads(selected.read_text())
        stages += sst2_privacy.privacy_runs(main, results, main["T"])
        stages += sst2_dp_regime.runs(main, results)
        stages += sst2_dp_valid.runs(main, results)
        stages += sst2_dp_fedpa.runs(main, results)
    return stages


def minutes_left(runs: list[Run], results: dict) -> float:
    """The machine minutes the runs without a result will take: by rounds
    (:func:`research.study.sst2_protocol.minutes_left`), the ``dpregime`` stage's by the records they train on
    (:func:`research.study.sst2_dp_regime.minutes`)."""
    by_records = (sst2_dp_regime.STAGE, sst2_dp_valid.STAGE, sst2_dp_fedpa.STAGE)
    regime = [r for r in runs if r.stage in by_records]
    return sp.minutes_left([r for r in runs if r.stage not in by_records], results) + sst2_dp_regime.minutes(
        regime, results
    )


def not_a_checkout(here: Path) -> str | None:
    """Why ``here`` is no checkout of fs_fedpa, whose committed results the default ``--report`` names (relative to
    the current folder), or None. From elsewhere, e.g. with an editable install, the protocol would be planned from
    scratch against an empty report folder there."""
    missing = [str(p) for p in (CFG_NAME, REPORT.parent) if not (here / p).exists()]
    if not missing:
        return None
    return (
        f"{here} is not a checkout of fs_fedpa (no {' or '.join(missing)} here), and the protocol's results would be "
        f"read from and written to {here / REPORT}: run this from a checkout, or pass --report DIR (and --work DIR)"
    )


def plan_only(results: dict, report: Path) -> list[tuple[str, list[Run]]]:
    """:func:`plan` without its writes: it freezes ``selected.json`` into the report folder once the committed runs
    decide it; here that happens on a copy in a temporary folder, so that ``--plan`` writes nothing in the report
    (and runs on a read-only checkout)."""
    with tempfile.TemporaryDirectory() as scratch:
        if (report / "selected.json").is_file():
            shutil.copy(report / "selected.json", scratch)
        return plan(results, Path(scratch))


def claim_work(work: Path) -> None:
    """Refuse to run while another call runs in the same ``work`` folder (two calls would start the same pending
    run in one folder, each deleting the other's outputs); a lock left by a call that died is taken over."""
    work.mkdir(parents=True, exist_ok=True)
    lock = work / "runner.pid"
    if lock.is_file():
        try:
            other = int(lock.read_text().strip())
            os.kill(other, 0)
        except (ValueError, ProcessLookupError):
            other = None
        except PermissionError:  # alive, another user's
            pass
        if other is not None and other != os.getpid():
            sys.exit(f"another sst2_compare call (pid {other}) runs in {work}; wait for it or stop it, then rerun")
    lock.write_text(str(os.getpid()))

    def release() -> None:
        try:
            if lock.read_text().strip() == str(os.getpid()):
                lock.unlink()
        except OSError:
            pass

    atexit.register(release)


def only(stages: list[tuple[str, list[Run]]], wanted) -> list[tuple[str, list[Run]]]:
    """The plan's parts with the runs ``wanted`` keeps (``--stage``, ``--cell``); parts left empty are dropped."""
    return [(part, kept) for part, runs in stages if (kept := [r for r in runs if wanted(r)])]


def print_plan(stages: list[tuple[str, list[Run]]], results: dict, scoped: bool = False) -> None:
    """Each part's runs done and the time left; ``scoped``: the parts are those --stage/--cell select, not the
    whole protocol, and the summary says so."""
    rate = seconds_per_round(results)
    total_left = 0.0
    for stage, runs in stages:
        left = [r for r in runs if r.key not in results]
        minutes = minutes_left(left, results)
        total_left += minutes
        print(f"  {stage}: {len(runs) - len(left)}/{len(runs)} runs done; about {minutes:.0f} min left", flush=True)
    if any(r.stage == sst2_dp_regime.STAGE for _, runs in stages for r in runs):
        low, high = sst2_dp_regime.stage_hours()
        print(f"  dp regime, the whole stage before any run: {low:.0f}-{high:.0f} CPU-h here, as the search selects "
              "(priced by records from the measured step cost, research/study/sst2_dp_regime.py)",
              flush=True)  # fmt: skip
    if any(r.stage == sst2_dp_valid.STAGE for _, runs in stages for r in runs):
        hours = sst2_dp_valid.stage_hours()
        print(f"  dp valid, the whole stage before any run: {hours:.0f} CPU-h here by the same pricing, which priced "
              "the dpregime finals at about 2x what they took (43 against 20 CPU-min a DP final): about "
              f"{hours * 20 / 43:.0f} CPU-h measured-rate, plus part E′ (about 1.2 CPU-h, priced as part E's runs "
              "took) (research/study/sst2_dp_valid.py)", flush=True)  # fmt: skip
    if any(r.stage == sst2_dp_fedpa.STAGE for _, runs in stages for r in runs):
        hours = sst2_dp_fedpa.stage_hours()
        print(f"  dp fedpa, the whole stage before any run: {hours:.1f} CPU-h here by the same pricing (about "
              f"{hours * 20 / 43:.1f} CPU-h at the rate the dpvalid finals took; research/study/sst2_dp_fedpa.py)",
              flush=True)  # fmt: skip
    if scoped and not stages:
        print("[sst2_compare] no run of the stages known now matches --stage/--cell: nothing to run (a cell is a "
              "run's name without its seed, e.g. fedpa_dp or partial30_fedit)", flush=True)  # fmt: skip
        return
    if scoped:
        dp_rate = seconds_per_round(results, True)
        print(f"[sst2_compare] the runs --stage/--cell select: about {total_left / 60:.1f} h left of the stages "
              f"known now ({rate:.0f} s a round, {dp_rate:.0f} under DP-SGD)", flush=True)  # fmt: skip
        return
    spent = time_spent(results)
    if not total_left:
        print(f"[sst2_compare] committed runs: {spent}; every run of the protocol has run", flush=True)
        return
    T = pilot_T(results[pilot_run().key]) if pilot_run().key in results else PILOT_ROUNDS // 2
    print(
        f"[sst2_compare] committed runs: {spent}; about {total_left / 60:.1f} h left for the "
        f"stages known now ({rate:.0f} s a round, {seconds_per_round(results, True):.0f} under DP-SGD); the whole "
        f"protocol is about {whole_rounds(T) * rate / 3600:.0f} h "
        f"with T = {T}{'' if pilot_run().key in results else ' (a guess until the pilot ends)'}",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
