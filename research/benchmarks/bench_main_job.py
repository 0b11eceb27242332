"""The main job as it ran before sequence packing (one padded forward a batch) against the job as the yaml runs it
now (``model.seqcls.pack_len``: each batch's records packed whole into rows), side by side in one run: the two
configs alternate, each in a fresh FS process, and the table gives each one's wall and CPU time, its final dev
accuracy under both protocols, and the ratio. A packed forward gives each record the padded forward's logits and
gradients to float summation order (tests/unit/test_sequence_packing.py and its FS twin in tests/integration/);
dropout draws its masks on the packed shape, so the two runs' trajectories differ as two seeds' would.

    python research/benchmarks/bench_main_job.py --data <GLUE dir> [--rounds 8] [--repeats 1] [--new KEY VALUE ...]

``--rounds 8`` is the whole job (594 s and 266 s measured on an idle 2-core host whose probe read 0.44 s); fewer
rounds time the training alone. ``--new`` gives the new job other FS overrides (e.g. ``model.seqcls.pack_len 0
model.seqcls.train_chunk 8`` for length-sorted chunks instead).

``--slow-host`` runs every job, and the probe, as a slower host would: MKL's SSE2-compatible code path
(``MKL_CBWR=COMPATIBLE``, which makes the probe's matrix product, and every dense product of the job, about 2.2x
slower on the project's AVX-512 host: probe 0.44 -> 0.96 s) and ATen's scalar kernels
(``ATEN_CPU_CAPABILITY=default``: no AVX2/AVX-512 in the element-wise ops, dropout, layer norm). The probe printed is
the one read under those settings, so the table says how long the job takes where the probe reads that: 418 s
(0.8406 dev) at probe 0.964, measured with ``--slow-host --only now`` (``--only`` runs one of the two jobs).
"""

from __future__ import annotations

import argparse
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CFG = ROOT / "yaml_configs" / "fedpa_sst2_minilm_cpu.yaml"
SLOW_HOST = {"MKL_CBWR": "COMPATIBLE", "ATEN_CPU_CAPABILITY": "default"}


def run(data: str, rounds: int, opts: list[str], out: Path) -> dict:
    """One FS run of the main job's config with the overrides ``opts``; its wall and CPU seconds and final
    metrics."""
    from fs_fedpa.tools.run import final_metrics

    cmd = [sys.executable, "-m", "federatedscope.main", "--cfg", str(CFG), "data.root", data, "outdir", str(out),
           "expname", "job", "federate.total_round_num", str(rounds), "eval.freq", str(min(4, rounds)),
           "fedpa.store.checkpoint", "False", *opts]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        label = " ".join(opts) or "the yaml as it is"
        sys.exit(f"the run with {label} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"wall": time.time() - start, "cpu": cpu, **final_metrics(out / "job")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="GLUE folder holding SST-2/")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, alternating")
    parser.add_argument("--new", nargs="*", default=[], metavar="KEY VALUE",
                        help="FS overrides of the new job (default: none, the yaml as it is)")  # fmt: skip
    parser.add_argument("--slow-host", action="store_true",
                        help="run the jobs and the probe on MKL's SSE2 path and ATen's scalar kernels (above)")
    parser.add_argument("--only", choices=("before", "now"), help="run one of the two jobs")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.repeats < 1 or len(args.new) % 2:
        parser.error("--rounds and --repeats must be >= 1, and --new takes KEY VALUE pairs")
    new = list(args.new)
    before = ["model.seqcls.pack_len", "0", "model.seqcls.train_chunk", "0", "model.seqcls.eval_chunk", "0"]
    jobs = [(n, o) for n, o in (("before", before), ("now", new)) if args.only in (None, n)]
    rows: dict[str, list[dict]] = {name: [] for name, _ in jobs}
    from research.harness.compare import host_record

    if args.slow_host:
        os.environ.update(SLOW_HOST)  # the probe's subprocess and every job's inherit it
        print(f"emulating a slower host: {' '.join(f'{k}={v}' for k, v in SLOW_HOST.items())}")
    print(f"host probe {host_record()['probe_cpu_seconds']} CPU s; before: {' '.join(before)}; now: "
          f"{' '.join(new) or 'the yaml as it is'}", flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, opts in jobs:
                rows[name].append(run(args.data, args.rounds, opts, Path(tmp) / f"{name}{i}"))
                r = rows[name][-1]
                print(f"  {name:6s} repeat {i}: {r['wall']:.0f} s wall, {r['cpu']:.0f} CPU-s, dev acc "
                      f"{r.get('val_acc', float('nan')):.4f} (own {r.get('local.val_acc', float('nan')):.4f})",
                      flush=True)  # fmt: skip
    mean = lambda name, key: sum(r[key] for r in rows[name]) / len(rows[name])  # noqa: E731
    print(f"\nmain job, {args.rounds} rounds, {args.repeats} pair(s), {os.cpu_count()} cores:")
    print("| job | wall s | CPU s | dev acc (paper) | dev acc (own) |")
    print("|---|---|---|---|---|")
    for name in rows:
        print(f"| {name} | {mean(name, 'wall'):.0f} | {mean(name, 'cpu'):.0f} | "
              f"{mean(name, 'val_acc'):.4f} | {mean(name, 'local.val_acc'):.4f} |")  # fmt: skip
    if len(rows) == 2:
        print(
            f"now / before: wall {mean('now', 'wall') / mean('before', 'wall'):.2f}x, "
            f"CPU {mean('now', 'cpu') / mean('before', 'cpu'):.2f}x"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
