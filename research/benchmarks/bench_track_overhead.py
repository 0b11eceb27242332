"""Does ``fedpa.track none`` cost anything? The tiny FS run's wall time at this checkout against another one (a
commit before the trackers), side by side in one call (run from the repo root).

Each run is one ``python -m federatedscope.main --cfg <tiny yaml>`` subprocess with ``PYTHONPATH`` set to its
checkout (the tests' tiny Llama, 3 clients, FedPA-LoRA, ``--rounds`` rounds; nothing downloaded). After one
untimed warm-up pair (bytecode compiled, files cached) the two checkouts alternate in pairs, so that a slow spell
of the machine hits both alike, and each pair flips the order (A B, B A, A B, ...: on a shared host the second of
two back-to-back runs can be the slower one, whichever checkout it is). A checkout whose config has
``fedpa.track`` gets ``fedpa.track none``; one without the key runs the same yaml as it is.

    git worktree add /tmp/base90 767ee2c
    python research/benchmarks/bench_track_overhead.py --baseline-repo /tmp/base90 [--repeats 5] [--rounds 3]

Prints every run's wall and CPU seconds and, for each, the medians and the median of the paired ratios
head / baseline (paired by repeat) with a 95% bootstrap interval, saying "within noise" only where it covers 1.
"""

from __future__ import annotations

import argparse
import random
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT))

from tests.integration.tiny_assets import dump_yaml, fs_env, fs_llm_yaml  # noqa: E402

# Whether the checkout's config knows fedpa.track, and that fs_fedpa imports from the checkout.
_PROBE = (
    "import dataclasses, fs_fedpa, fs_fedpa.config as c\n"
    "print(fs_fedpa.__file__)\n"
    "print('track' in {f.name for f in dataclasses.fields(c.FedPAConfig)})\n"
)


def checkout_opts(repo: Path, cwd: Path) -> list[str]:
    """The overrides the run at ``repo`` gets: ``fedpa.track none`` where its config has the key."""
    env = fs_env({"PYTHONPATH": str(repo)})
    done = subprocess.run([sys.executable, "-c", _PROBE], cwd=cwd, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{repo}: cannot import its fs_fedpa:\n{done.stderr[-2000:]}")
    where, has_track = done.stdout.split()
    if not Path(where).resolve().is_relative_to(repo.resolve()):
        sys.exit(f"{repo}: fs_fedpa imports from {where}, not from the checkout")
    return ["fedpa.track", "none"] if has_track == "True" else []


def run_once(repo: Path, cfg: str, opts: list[str], out: Path, cwd: Path) -> tuple[float, float]:
    """Wall and CPU (user + system) seconds of one FS run of ``cfg`` at ``repo``, interpreter start and imports
    included; the CPU time does not grow when other work shares the cores."""
    cmd = [sys.executable, "-m", "federatedscope.main", "--cfg", cfg, "outdir", str(out), *opts]
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.perf_counter()
    done = subprocess.run(cmd, cwd=cwd, env=fs_env({"PYTHONPATH": str(repo)}), capture_output=True, text=True)
    wall, after = time.perf_counter() - start, resource.getrusage(resource.RUSAGE_CHILDREN)
    if done.returncode != 0:
        sys.exit(f"the run at {repo} failed:\n{done.stdout[-2000:]}{done.stderr[-2000:]}")
    return wall, (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)


def bootstrap_median(values: list[float], draws: int = 5000, seed: int = 0) -> tuple[float, float]:
    """95% percentile bootstrap interval of the median of ``values``."""
    rng = random.Random(seed)
    medians = sorted(statistics.median(rng.choices(values, k=len(values))) for _ in range(draws))
    return medians[int(0.025 * draws)], medians[int(0.975 * draws) - 1]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--baseline-repo", type=Path, required=True, help="the other checkout (a git worktree)")
    parser.add_argument("--repeats", type=int, default=5, help="timed runs of each checkout, alternating")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    if args.repeats < 1 or args.rounds < 1:
        parser.error("--repeats and --rounds must be >= 1")
    if not (args.baseline_repo / "fs_fedpa").is_dir():
        parser.error(f"--baseline-repo {args.baseline_repo}: no fs_fedpa/ in it (a checkout of this project)")
    from fs_fedpa.tools.tiny_llm import build_tiny_llama, write_instruction_jsonl

    repos = {"head": ROOT, "baseline": args.baseline_repo.resolve()}
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)  # also the runs' working directory: no checkout on sys.path through it
        data, texts = write_instruction_jsonl(work / "data.jsonl", 60)
        model = build_tiny_llama(work / "tiny_llama", texts)
        cfg = dump_yaml(fs_llm_yaml(work, model, data, **{
            "federate.method": "fedpa", "federate.total_round_num": args.rounds,
            "federate.share_local_model": True, "expname": "track", "fedpa.lam": 1.0,
        }), work / "tiny.yaml")  # fmt: skip
        opts = {name: checkout_opts(repo, work) for name, repo in repos.items()}
        for name, repo in repos.items():
            print(f"{name}: {repo} ({' '.join(opts[name]) or 'no fedpa.track key: the yaml as it is'})")
        times: dict[str, list[tuple[float, float]]] = {name: [] for name in repos}
        for i in range(-1, args.repeats):  # repeat -1: the untimed warm-up pair
            for name, repo in list(repos.items())[:: 1 if i % 2 else -1]:  # ABBA: neither always goes first
                wall, cpu = run_once(repo, cfg, opts[name], work / f"{name}{i}", work)
                if i >= 0:
                    times[name].append((wall, cpu))
                what = "warm-up" if i < 0 else f"repeat {i}"
                print(f"  {what:8s} {name:8s} {wall:6.2f} s wall, {cpu:6.2f} CPU-s", flush=True)
    few = " (under 5 repeats the interval is about the range of the ratios: a sketch, not a test)"
    print(f"{args.repeats} runs each, {args.rounds} rounds{few if args.repeats < 5 else ''}:")
    for k, kind in enumerate(("wall", "CPU")):
        head, base = [t[k] for t in times["head"]], [t[k] for t in times["baseline"]]
        ratios = [h / b for h, b in zip(head, base)]
        low, high = bootstrap_median(ratios)
        verdict = "within noise" if low <= 1 <= high else ("slower" if low > 1 else "faster")
        print(f"  {kind:4s}: median head {statistics.median(head):.2f} s, baseline {statistics.median(base):.2f} s; "
              f"head / baseline {statistics.median(ratios):.3f}x, 95% bootstrap interval [{low:.3f}, {high:.3f}] "
              f"(paired ratios min {min(ratios):.3f}, max {max(ratios):.3f}): {verdict}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
