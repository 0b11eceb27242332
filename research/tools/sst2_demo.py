"""The main job: FedPA-LoRA on real SST-2 with the embedded MiniLM backbone, through stock FederatedScope.

``python -m research.tools.sst2_demo --data <GLUE dir>`` runs ``python -m federatedscope.main`` on
``yaml_configs/fedpa_sst2_minilm_cpu.yaml`` in a subprocess, shows its progress as it goes, and ends with
the final SST-2 dev accuracy under both evaluation protocols and where the logs and diagnostics are.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

from fs_fedpa.fs_results import ROUND_START, last_weighted_avg
from research.harness.fs_command import fs_overrides
from research.tools.checkout import find_checkout

CFG_NAME = Path("yaml_configs") / "fedpa_sst2_minilm_cpu.yaml"  # in the checkout (./run.sh runs from its root)
CLIENT = re.compile(
    r"'Role': 'Client #(\d+)', 'Round': (\d+), 'Results_raw': \{.*?'train_acc': (?:np\.float64\()?([\d.]+)"
)
SERVER = re.compile(r"'Role': 'Server #', 'Round': (\d+), 'Results_weighted_avg': \{(.*?)\}")
CLIENT_EVAL = re.compile(r"'Role': 'Client #(\d+)', 'Round': \d+, 'Results_raw': \{([^}]*'val_total'[^}]*)\}")
SHARD = re.compile(r"'val_(acc|total)': (?:np\.float64\()?([\d.]+)")  # 'local.val_acc' has no quote before val_
DIAGNOSTICS = re.compile(r"\[fedpa\] round (\d+): ([^\x1b]*)")
METRIC = re.compile(r"'((?:local\.)?val_acc)': (?:np\.float64\()?([\d.]+)")
# Wall minutes of the main job (the checkout's yaml, 2 free CPU cores) per CPU second of the host probe
# (research.harness.compare.host_record): with packed rows the FS run took 266 s where the probe read 0.437 s
# (10.1 min/s; research/benchmarks/bench_main_job.py), and 418 s on that host slowed to a probe of 0.964 s (7.2 min/s;
# --slow-host): part of the job does not scale with the probe, so this rate is an upper estimate on slower hosts;
# padded rows took 22.6 min/s.
MINUTES_PER_PROBE_SECOND = 10.0


def progress(line: str, rounds: int) -> str | None:
    """A short progress line for the FS log lines that mark progress, else None."""
    if match := ROUND_START.search(line):
        return f"round {int(match.group(1)) + 1}/{rounds}: local training on every client"
    if match := CLIENT.search(line):
        return f"  client {match.group(1)}: train accuracy {float(match.group(3)):.3f}"
    if match := SERVER.search(line):
        accs = dict(METRIC.findall(match.group(2)))
        paper, own = accs.get("val_acc"), accs.get("local.val_acc")
        if paper:
            return f"  dev accuracy after round {int(match.group(1)) + 1}: {float(paper):.4f} (paper protocol)" + (
                f", {float(own):.4f} (clients' own factors)" if own else ""
            )
    if match := DIAGNOSTICS.search(line):  # the server counts rounds from 0
        return f"  aggregation of round {int(match.group(1)) + 1}: {match.group(2).strip()}"
    return None


class Clock:
    """The time left, from the rounds done so far: after round 1 ends, ``mean seconds a round x rounds left``."""

    def __init__(self, rounds: int):
        self.rounds, self.start = rounds, None  # start: (time, FS round index) of the first round seen starting

    def line(self, log_line: str, now: float) -> str | None:
        """An estimate when ``log_line`` starts a training round after the first one seen, else None."""
        if not (match := ROUND_START.search(log_line)):
            return None
        r = int(match.group(1))  # FS's round index: r rounds are done
        if self.start is None:
            self.start = (now, r)
            return None
        per_round = (now - self.start[0]) / max(r - self.start[1], 1)
        left = per_round * (self.rounds - r)
        return f"  about {left / 60:.1f} min left ({per_round:.0f} s a round so far, {self.rounds - r} rounds to go)"


def expected_minutes(probe: float) -> str:
    """The main job's expected wall time on a host whose probe (:func:`research.harness.compare.host_record`) reads
    ``probe`` CPU seconds, from :data:`MINUTES_PER_PROBE_SECOND`."""
    minutes = MINUTES_PER_PROBE_SECOND * probe
    return (f"this host's probe reads {probe:.2f} CPU s, so expect about {minutes:.0f} minutes on 2 free cores "
            f"({MINUTES_PER_PROBE_SECOND:g} per probe second); after round 1 it prints the time left")


def find_glue_dir(given: str | None) -> Path:
    """The GLUE folder from ``--data`` or ``FS_FEDPA_DATA``; exits with a plain message when it is missing."""
    value = given or os.environ.get("FS_FEDPA_DATA")
    hint = (
        "Pass the folder that holds GLUE in its standard layout (it must contain SST-2/train.tsv and "
        "SST-2/dev.tsv):\n  ./run.sh --data /path/to/glue\nor set FS_FEDPA_DATA=/path/to/glue."
    )
    if not value:
        sys.exit(f"No GLUE data folder given. {hint}")
    root = Path(value).expanduser().resolve()
    if (root / "glue" / "SST-2").is_dir() and not (root / "SST-2").is_dir():
        root = root / "glue"  # accept the parent of glue/ too (e.g. shared/data)
    missing = [p for p in (root / "SST-2" / "train.tsv", root / "SST-2" / "dev.tsv") if not p.is_file()]
    if missing:
        sys.exit(f"{', '.join(map(str, missing))} not found. {hint}")
    return root


def final_accuracy(outdir: Path) -> dict[str, float]:
    """The last round's weighted-average metrics from FS's eval_results.log."""
    return last_weighted_avg(outdir / "eval_results.log")


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", help="GLUE folder (or set FS_FEDPA_DATA)")
    parser.add_argument("--cfg", default=None, help=f"FS yaml (default: the checkout's {CFG_NAME})")
    parser.add_argument("--repo", default=None, help="the fs_fedpa checkout holding --cfg's default (default: here)")
    parser.add_argument("--outdir", default="exp", help="FS outdir")
    parser.add_argument("opts", nargs="*", help="extra FS overrides, KEY VALUE ...")
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if len(args.opts) % 2:
        sys.exit(f"FS overrides come in KEY VALUE pairs; got {len(args.opts)} words: {' '.join(args.opts)}")
    default_cfg = args.cfg is None
    if default_cfg:
        args.cfg = str(find_checkout(args.repo, [str(CFG_NAME)], "sst2_demo") / CFG_NAME)
    if not Path(args.cfg).is_file():
        sys.exit(f"--cfg {args.cfg}: no such FS config")
    root = find_glue_dir(args.data)
    save_to = str(Path(args.outdir) / "fedpa_sst2_minilm_cpu.ckpt")
    cmd = [
        sys.executable,
        "-m",
        "federatedscope.main",
        "--cfg",
        args.cfg,
        "data.root",
        str(root),
        "outdir",
        args.outdir,
        "federate.save_to",
        save_to,
        # each client's dev examples (fedpa_eval_shards.json): docs/load_export.py reads them
        "fedpa.records.save_outcomes",
        "True",
        *fs_overrides(args.opts),
    ]
    env = dict(os.environ, HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    print(f"[fs_fedpa] FedPA-LoRA on SST-2 from {root}\n[fs_fedpa] {' '.join(cmd)}", flush=True)
    if default_cfg and not args.opts:  # the time of another config or overrides is its own
        from research.harness.compare import host_record

        if probe := host_record()["probe_cpu_seconds"]:
            print(f"[fs_fedpa] {expected_minutes(probe)}", flush=True)
    start = time.time()
    log_lines: list[str] = []
    rounds = _rounds(args.cfg, args.opts)
    clock = Clock(rounds)
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env) as proc:
        for line in proc.stdout:
            log_lines.append(line)
            if (shown := progress(line, rounds)) is not None:
                print(f"[{time.time() - start:5.0f}s] {shown}", flush=True)
            if (left := clock.line(line, time.time())) is not None:
                print(f"[{time.time() - start:5.0f}s] {left}", flush=True)
    if proc.returncode != 0:
        sys.stdout.write("".join(log_lines[-40:]))
        print(f"[fs_fedpa] FederatedScope exited with {proc.returncode}", file=sys.stderr)
        return proc.returncode
    outdir = _outdir_from_log(log_lines) or Path(args.outdir)
    shards = client_shards(log_lines)
    metrics = final_accuracy(outdir)
    print(f"\n[fs_fedpa] finished in {time.time() - start:.0f} s")
    paper, own = metrics.get("val_acc", float("nan")), metrics.get("local.val_acc", float("nan"))
    print(f"final SST-2 dev accuracy (global reference + local head, paper protocol): {paper:.4f}")
    print(f"final SST-2 dev accuracy (each client's own factors + local head):       {own:.4f}")
    if shards:
        per_client = ", ".join(f"client {c}: {acc:.3f} on {n}" for c, (acc, n) in sorted(shards.items()))
        print(f"  (weighted over the clients' dev shards, which follow their LDA-skewed train labels; {per_client})")
    print(f"logs and results: {outdir}  (eval_results.log, exp_print.log)")
    print(f"FedPA diagnostics: {outdir / 'fedpa_diagnostics.jsonl'}")
    print(f"checkpoints (global adapter, each client's own state): {Path(save_to).parent}")
    return show_export(outdir)


def show_export(outdir: Path) -> int:
    """Export the run's adapters (PEFT directories) into ``<outdir>/export`` and print how to load them."""
    from fs_fedpa.plugin.export_run_fs import export_run

    try:
        out = export_run(outdir, outdir / "export", clients=True)
    except ValueError as exc:
        print(f"[fs_fedpa] could not export the adapters: {exc}", file=sys.stderr)
        return 1
    print(f"\nPEFT adapters (global, every client's head and own model): {out}  (its README.md says more)")
    print("load the global adapter with client 1's head (the paper protocol's model of client 1):")
    info = json.loads((out / "export.json").read_text())
    print(f"    from peft import PeftModel\n    from safetensors.torch import load_file\n"
          f"    from transformers import AutoModelForSequenceClassification\n"
          f"    base = AutoModelForSequenceClassification.from_pretrained('{info['base_model']}', num_labels=2)\n"
          f"    model = PeftModel.from_pretrained(base, '{out / 'global'}')\n"
          f"    model.load_state_dict(load_file('{out / 'heads/client_1.safetensors'}'), strict=False)")  # fmt: skip
    print(f"or: python docs/load_export.py --export {out} --run {outdir} --data <GLUE dir> --client 1")
    return 0


def client_shards(lines: list[str]) -> dict[int, tuple[float, int]]:
    """``client -> (val_acc, val_total)`` of each client's last evaluation (paper protocol), from FS's log."""
    shards = {}
    for line in lines:
        if match := CLIENT_EVAL.search(line):  # FS orders the metric keys arbitrarily
            values = dict(SHARD.findall(match.group(2)))
            shards[int(match.group(1))] = (float(values["acc"]), int(float(values["total"])))
    return shards


def _rounds(cfg_file: str, opts: list[str]) -> int:
    import yaml

    for key, value in zip(opts[::2], opts[1::2]):
        if key == "federate.total_round_num":
            return int(value)
    with open(cfg_file) as f:
        return int(yaml.safe_load(f)["federate"]["total_round_num"])


def _outdir_from_log(lines: list[str]) -> Path | None:
    """FS prints the outdir it chose (it adds sub_exp_<time> when the folder exists already)."""
    for line in lines:
        match = re.search(r"the output dir is (\S+)", line) or re.search(r"outdir: (\S+)", line)
        if match and Path(match.group(1)).is_dir():
            return Path(match.group(1))
    return None


if __name__ == "__main__":
    sys.exit(main())
