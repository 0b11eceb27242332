"""The main job with one padded forward a batch (as it ran before) against the job with length-sorted chunked
forwards (``model.seqcls.train_chunk`` and ``eval_chunk``, the yaml's values unless given), side by side in one run:
the two configs alternate, each in a fresh FS process, and the table gives each one's wall and CPU time, its final
dev accuracy under both protocols, and the ratio. A chunk's gradient is summed with weight n_c/n, so the step is the
batch's mean-loss gradient, and an evaluation chunk's logits are those of one forward, to float summation order
(tests/integration/test_seqcls_chunks_fs.py).

    python benchmarks/bench_main_job.py --data <GLUE dir> [--rounds 8] [--repeats 1] [--chunk N] [--eval-chunk N]

``--rounds 8`` is the whole job (about 5 minutes each on an idle 2-core host); fewer rounds time the training alone.
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

ROOT = Path(__file__).resolve().parents[1]
CFG = ROOT / "yaml_configs" / "fedpa_sst2_minilm_cpu.yaml"


def run(data: str, rounds: int, chunks: list[str], out: Path) -> dict:
    """One FS run of the main job's config with the overrides ``chunks``; its wall and CPU seconds and final
    metrics."""
    from fs_fedpa.tools.run import final_metrics

    cmd = [sys.executable, "-m", "federatedscope.main", "--cfg", str(CFG), "data.root", data, "outdir", str(out),
           "expname", "job", "federate.total_round_num", str(rounds), "eval.freq", str(min(4, rounds)),
           "fedpa.checkpoint", "False", *chunks]  # fmt: skip
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    before, start = resource.getrusage(resource.RUSAGE_CHILDREN), time.time()
    proc = subprocess.run(cmd, capture_output=True, text=True, env=env)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        label = " ".join(chunks) or "the yaml's chunks"
        sys.exit(f"the run with {label} failed:\n{proc.stdout[-3000:]}{proc.stderr[-3000:]}")
    cpu = (after.ru_utime + after.ru_stime) - (before.ru_utime + before.ru_stime)
    return {"wall": time.time() - start, "cpu": cpu, **final_metrics(out / "job")}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", required=True, help="GLUE folder holding SST-2/")
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--repeats", type=int, default=1, help="pairs of runs, alternating")
    parser.add_argument("--chunk", type=int, default=None, help="training records a forward (default: the yaml's)")
    parser.add_argument("--eval-chunk", type=int, default=None,
                        help="evaluation records a forward (default: the yaml's)")  # fmt: skip
    args = parser.parse_args(argv)
    chunked = [*(["model.seqcls.train_chunk", str(args.chunk)] if args.chunk is not None else []),
               *(["model.seqcls.eval_chunk", str(args.eval_chunk)] if args.eval_chunk is not None else [])]
    one = ["model.seqcls.train_chunk", "0", "model.seqcls.eval_chunk", "0"]
    rows: dict[str, list[dict]] = {"one forward": [], "chunked": []}
    from fs_fedpa.harness.compare import host_record

    print(f"host probe {host_record()['probe_cpu_seconds']} CPU s; chunked: {' '.join(chunked) or 'the yaml'}",
          flush=True)  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for i in range(args.repeats):
            for name, chunks in (("one forward", one), ("chunked", chunked)):
                rows[name].append(run(args.data, args.rounds, chunks, Path(tmp) / f"{name.replace(' ', '_')}{i}"))
                r = rows[name][-1]
                print(f"  {name:11s} repeat {i}: {r['wall']:.0f} s wall, {r['cpu']:.0f} CPU-s, dev acc "
                      f"{r.get('val_acc', float('nan')):.4f} (own {r.get('local.val_acc', float('nan')):.4f})",
                      flush=True)  # fmt: skip
    mean = lambda name, key: sum(r[key] for r in rows[name]) / len(rows[name])  # noqa: E731
    print(f"\nmain job, {args.rounds} rounds, {args.repeats} pair(s), {os.cpu_count()} cores:")
    print("| job | wall s | CPU s | dev acc (paper) | dev acc (own) |")
    print("|---|---|---|---|---|")
    for name in rows:
        print(f"| {name} | {mean(name, 'wall'):.0f} | {mean(name, 'cpu'):.0f} | "
              f"{mean(name, 'val_acc'):.4f} | {mean(name, 'local.val_acc'):.4f} |")  # fmt: skip
    print(f"chunked / one forward: wall {mean('chunked', 'wall') / mean('one forward', 'wall'):.2f}x, "
          f"CPU {mean('chunked', 'cpu') / mean('one forward', 'cpu'):.2f}x")
    return 0


if __name__ == "__main__":
    sys.exit(main())
