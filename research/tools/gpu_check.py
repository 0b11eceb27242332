"""Does FedPA-LoRA work on this device, and what does it cost? One command, a few minutes, one table and its JSON.

    python -m research.tools.gpu_check [--device cuda] [--tiny] [--only STEP ...] [--out FILE]
        [--data GLUE_DIR] [--model MINILM_DIR]
    python -m research.tools.gpu_check --prepare DIR     # what a GPU host needs beside the tree (docs/gpu.md)

Steps (each timed; a failure is recorded and the next step runs; ``--only`` reruns some alone):

- ``env``: torch and its CUDA build, the device, FederatedScope, transformers and PEFT;
- ``standalone``: FS standalone runs of FedPA-LoRA and FedIT on SST-2 (a train subset, a few rounds) on the device
  in float32 and in half precision by the plugin's own route (``model.seqcls.precision fp16``, autocast);
- ``cpu_match``: the first round's global adapter of FedPA-LoRA on the device against the same round on the CPU,
  from the same (fp16-widened) weights with dropout off: relative difference of ``sum ΔW`` in Frobenius norm,
  tolerance ``MATCH_TOLERANCE``;
- ``distributed``: a server and 2 clients over gRPC on loopback, message authentication on, every party on the
  device (``scripts/run_distributed.sh`` with ``GPUS``);
- ``reconstruct``, ``adapter`` (float32 and float16 uploads), ``penalty``: the benchmarks on the device;
- ``clients``: ``bench_clients`` at N = 10 and N = 100 (K = 10) with the state budget, the device's peak memory;
- ``dp_sgd``: ``bench_dp_sgd``, a DP-SGD step (per-example gradients by batched taps and by a per-example loop)
  against a plain step, on MiniLM and SST-2.

``--tiny`` runs the same steps at tiny sizes (a random 2-layer BERT, synthetic SST-2) in a couple of minutes;
with ``--device cpu`` it skips what the CPU refuses (half precision) and says so. The benchmarks, the launch script
and the configs are read from a checkout of this project: ``--repo DIR``, else the working directory, else the
checkout of an editable install (:mod:`research.tools.checkout`); without one it stops at start and says so.

Why one module over 450 lines: one command whose nine steps (10 to 45 lines each) read top to bottom in the order
they run, with the few helpers they share; apart, a reader on a borrowed GPU host would follow one step across files.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import signal
import socket
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from fs_fedpa.tools import cli
from research.tools.checkout import find_checkout
from research.tools.gpu_prepare import MINILM, prepare

NEEDS = ("yaml_configs", "scripts", "research")  # what the steps read from the checkout
STEPS = ("env", "standalone", "cpu_match", "distributed", "reconstruct", "adapter", "penalty", "clients", "dp_sgd",
         "paper_shapes")
# float32 on both sides, dropout off, the same weights and batches: only the kernels' summation order differs
# (about 1e-6 relative per operation), which a round of AdamW steps and the server's SVD carry to about 1e-5 in
# the global update; a placement or precision fault (a reference left on the host, a dropped client, an fp16
# path) moves it by O(1). 1e-3 leaves two orders of margin over the first and catches the second.
MATCH_TOLERANCE = 1e-3

# A child process runs FS's own entry point, then reports the device's peak memory.
_CHILD = (
    "import json, runpy, sys, time, torch\n"
    "start = time.perf_counter()\n"
    "sys.argv = ['federatedscope.main', '--cfg', *sys.argv[1:]]\n"
    "runpy.run_module('federatedscope.main', run_name='__main__')\n"
    "peak = torch.cuda.max_memory_allocated() if torch.cuda.is_initialized() else 0\n"
    "print('GPU_CHECK ' + json.dumps({'seconds': time.perf_counter() - start, 'device_peak_mb': peak / 2**20}))\n"
)


class Skip(Exception):
    """A step that cannot run here, with the reason."""


class Check:
    """The run's settings and the assets its steps share (made once, on first use)."""

    def __init__(self, args: argparse.Namespace):
        self.device = args.device
        self.cuda = args.device.startswith("cuda")
        self.tiny = args.tiny
        self.work = Path(args.work).resolve()
        self.data, self.model = args.data, args.model
        self.timeout = args.step_timeout
        self.repo: Path = args.repo  # the checkout: research/benchmarks/, scripts/ and yaml_configs/
        self._assets: tuple[str, str] | None = None

    @property
    def gpu_opts(self) -> list[str]:
        index = (int(self.device.split(":")[1]) if ":" in self.device else 0) if self.cuda else -1
        return ["use_gpu", str(self.cuda), "device", str(index)]

    def assets(self) -> tuple[str, str]:
        """``(GLUE root, model dir)``: synthetic SST-2 and a random BERT with --tiny, else the given data and the
        MiniLM weights widened to float32."""
        if self._assets is None:
            if self.tiny:
                from fs_fedpa.tools.tiny_llm import build_tiny_bert, write_tiny_glue

                root, texts = write_tiny_glue(self.work / "glue", n_train=240, n_dev=60)
                self._assets = (root, build_tiny_bert(self.work / "tiny_bert", texts))
            else:
                if not self.data or not (Path(self.data) / "SST-2" / "train.tsv").is_file():
                    raise Skip(f"--data must name a GLUE folder with SST-2/train.tsv (got {self.data!r})")
                self._assets = (str(Path(self.data).resolve()), widened(self.model or MINILM, self.work / "model"))
        return self._assets

    def fs_opts(self, name: str, method: str, rounds: int, on_device: bool = True) -> list[str]:
        glue, model = self.assets()
        out = self.work / name
        tiny = ["federate.client_num", "3", "train.local_update_steps", "4", "dataloader.batch_size", "8"]
        full = ["federate.client_num", "4", "train.local_update_steps", "10", "data.glue_limit", "2000"]
        sizes = [*tiny, "llm.tok_len", "16"] if self.tiny else full
        gpu = self.gpu_opts if on_device else ["use_gpu", "False", "device", "-1"]
        return [
            str(self.repo / "yaml_configs" / "fedpa_sst2_minilm_cpu.yaml"),
            *gpu, "data.root", glue, "model.type", f"{model}@seqcls_llm", "federate.method", method,
            "federate.total_round_num", str(rounds), "outdir", str(out), "expname", name,
            "federate.save_to", str(out / "ckpt.pt"), "fedpa.num_threads", "1" if self.tiny else "2", *sizes,
        ]  # fmt: skip

    def run_children(self, runs: dict[str, list[str]]) -> dict[str, dict]:
        """FS runs side by side, each in a child process (FS keeps global state); ``name -> result``."""
        env = child_env(self.repo)
        procs = {}
        for name, argv in runs.items():
            (self.work / name).mkdir(parents=True, exist_ok=True)
            log = open(self.work / name / "run.log", "w")
            argv = [sys.executable, "-c", _CHILD, *argv]
            proc = subprocess.Popen(argv, stdout=log, stderr=log, env=env, cwd=self.work, start_new_session=True)
            procs[name] = (proc, log, time.perf_counter())
        results = {}
        for name, (proc, log, start) in procs.items():
            try:
                proc.wait(timeout=max(1.0, self.timeout - (time.perf_counter() - start)))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
            log.close()
            results[name] = fs_result(self.work / name, proc.returncode)
        return results


def child_env(repo: Path) -> dict:
    path = os.pathsep.join(p for p in (str(repo), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1",
                TOKENIZERS_PARALLELISM="false", PROTOCOL_BUFFERS_PYTHON_IMPLEMENTATION="python")  # fmt: skip


def fs_result(folder: Path, returncode: int | None) -> dict:
    """A finished FS run: exit status, its last evaluation (weighted over clients), time and device peak memory."""
    from fs_fedpa.fs_results import weighted_avg_by_round

    text = (folder / "run.log").read_text(errors="replace")
    report = next((json.loads(x[10:]) for x in text.splitlines() if x.startswith("GPU_CHECK ")), None)
    logs = sorted(folder.rglob("eval_results.log"))
    rounds = weighted_avg_by_round(logs[-1]) if logs else {}
    last = rounds[max(rounds)] if rounds else {}
    ok = returncode == 0 and report is not None and bool(rounds)
    out = {"ok": ok, "returncode": returncode, "last_round": max(rounds) if rounds else None}  # FS counts from 0
    out["val_acc"] = last.get("val_acc")
    if report:
        out.update(seconds=round(report["seconds"], 1), device_peak_mb=round(report["device_peak_mb"], 1))
    if not ok:
        out["log_tail"] = text[-1500:]
    return out


def widened(name: str, out: Path) -> str:
    """The model's weights in float32 at ``out`` (a carried fp16 copy is widened here; float32 is used as is)."""
    import torch
    from transformers import AutoModel, AutoTokenizer

    from fs_fedpa.plugin.seqcls import resolve_model_path

    path = resolve_model_path(name)
    if (out / "config.json").is_file():
        return str(out)
    model = AutoModel.from_pretrained(path, dtype=torch.float32)
    model.float().save_pretrained(str(out))
    AutoTokenizer.from_pretrained(path).save_pretrained(str(out))
    return str(out)


def without_dropout(model_dir: str, out: Path) -> str:
    """A copy of the model folder whose config turns dropout off (CPU and CUDA draw different masks)."""
    if not out.is_dir():
        shutil.copytree(model_dir, out)
        config = json.loads((out / "config.json").read_text())
        config.update(hidden_dropout_prob=0.0, attention_probs_dropout_prob=0.0, classifier_dropout=0.0)
        (out / "config.json").write_text(json.dumps(config, indent=2))
    return str(out)


# ----------------------------------------------------------------------------------------------------- steps
def step_env(check: Check) -> dict:
    import torch

    out = {"torch": torch.__version__, "cuda_build": torch.version.cuda, "python": platform.python_version(),
           "host": platform.node(), "cpu_count": os.cpu_count()}  # fmt: skip
    for package in ("transformers", "peft", "federatedscope"):
        try:
            out[package] = getattr(__import__(package), "__version__", "installed")
        except ImportError as exc:
            out[package] = f"missing: {exc}"
    if check.cuda:
        if not torch.cuda.is_available():
            raise RuntimeError(f"--device {check.device}, but torch {torch.__version__} sees no CUDA device")
        props = torch.cuda.get_device_properties(torch.device(check.device))
        out.update(device_name=props.name, device_memory_gib=round(props.total_memory / 2**30, 1),
                   capability=f"{props.major}.{props.minor}", bf16=torch.cuda.is_bf16_supported())  # fmt: skip
    else:
        out["device_name"] = platform.processor() or "cpu"
    out["summary"] = f"{out['device_name']}, torch {out['torch']}"
    return out


def step_standalone(check: Check) -> dict:
    rounds = 2 if check.tiny else 3
    precisions = ["fp32", "fp16"] if check.cuda else ["fp32"]
    runs = {
        f"{method}_{p}": [*check.fs_opts(f"{method}_{p}", method, rounds), "model.seqcls.precision", p]
        for method in ("fedpa", "fedit")
        for p in precisions
    }
    out = check.run_children(runs)
    if not check.cuda:
        out["fp16"] = "skipped: half precision (model.seqcls.precision fp16) is the GPU route; the CPU refuses it"
    failed = [n for n, r in out.items() if isinstance(r, dict) and not r["ok"]]
    if failed:
        raise StepFailed(out, f"failed: {', '.join(failed)}")
    done = {n: r for n, r in out.items() if isinstance(r, dict) and r["val_acc"] is not None}
    accs = ", ".join(f"{n} {r['val_acc']:.4f} in {r['seconds']:.0f} s" for n, r in done.items())
    out["summary"] = f"{rounds} rounds, final val acc: {accs}"
    return out


def step_cpu_match(check: Check) -> dict:
    _, model = check.assets()
    plain = without_dropout(model, check.work / "model_no_dropout")
    runs = {}
    for where, on_device in (("device", True), ("cpu", False)):
        name = f"match_{where}"
        argv = check.fs_opts(name, "fedpa", 1, on_device)
        argv += ["model.type", f"{plain}@seqcls_llm", "fedpa.export.dir", str(check.work / name / "export")]
        runs[name] = argv
    out = check.run_children(runs)
    if not all(r["ok"] for r in out.values()):
        raise StepFailed(out, "a run failed")
    diff = relative_difference(check.work / "match_device" / "export", check.work / "match_cpu" / "export")
    out.update(relative_difference=diff, tolerance=MATCH_TOLERANCE)
    note = "" if check.cuda else " (device is the CPU: both runs on it; checks the route, not a device)"
    out["summary"] = f"round-1 global adapter, device vs CPU: {diff:.2e} (tolerance {MATCH_TOLERANCE:g}){note}"
    if not diff <= MATCH_TOLERANCE:
        raise StepFailed(out, out["summary"])
    return out


def relative_difference(export_a: Path, export_b: Path) -> float:
    """``||sum_m (ΔW_a,m - ΔW_b,m)||_F / ||ΔW_b||_F`` over the global adapters' modules, ``ΔW = B A`` in float64."""
    from safetensors.torch import load_file

    def deltas(folder: Path) -> dict:
        tensors = load_file(str(folder / "global" / "adapter_model.safetensors"))
        return {k[: -len("lora_A.weight")]: tensors[k[: -len("A.weight")] + "B.weight"].double() @ v.double()
                for k, v in tensors.items() if k.endswith("lora_A.weight")}  # fmt: skip

    a, b = deltas(export_a), deltas(export_b)
    if set(a) != set(b) or not a:
        raise RuntimeError(f"the two exports hold different modules: {sorted(set(a) ^ set(b))[:4]}")
    num = sum(float((a[m] - b[m]).pow(2).sum()) for m in a)
    den = sum(float(b[m].pow(2).sum()) for m in b)
    return (num / den) ** 0.5 if den > 0 else float("inf")


def step_distributed(check: Check) -> dict:
    import yaml

    script = check.repo / "scripts" / "run_distributed.sh"
    glue, model = check.assets()
    folder = check.work / "distributed"
    folder.mkdir(parents=True, exist_ok=True)
    ports = free_ports(3)
    cfgs = []
    for i, party in enumerate(("server", "client_1", "client_2")):
        cfg = yaml.safe_load((check.repo / "yaml_configs" / "distributed" / f"{party}.yaml").read_text())
        cfg["federate"].update(client_num=2, total_round_num=2, save_to=str(folder / f"{party}.ckpt"))
        cfg["distribute"].update(server_port=ports[0], client_port=ports[i])
        cfg["data"]["root"], cfg["model"]["type"] = glue, f"{model}@seqcls_llm"
        cfg.update(outdir=str(folder / party))
        cfg["train"]["local_update_steps"] = 4 if check.tiny else 10
        if check.tiny:
            cfg["llm"]["tok_len"], cfg["dataloader"]["batch_size"] = 16, 8
        else:
            cfg["data"]["glue_limit"] = 2000
        path = folder / f"{party}.yaml"
        path.write_text(yaml.safe_dump(cfg))
        cfgs.append(str(path))
    env = dict(child_env(check.repo), LOGDIR=str(folder / "logs"), JOIN_WAIT="3", AUTH="1", PYTHON=sys.executable)
    if check.cuda:
        env["GPUS"] = check.gpu_opts[3]
    start = time.perf_counter()
    code, stdout, stderr = run_group(["bash", str(script), *cfgs], env, check.work, check.timeout)
    from fs_fedpa.fs_results import weighted_avg_by_round

    logs = sorted((folder / "server").rglob("eval_results.log"))
    rounds = weighted_avg_by_round(logs[-1]) if logs else {}
    last = max(rounds, default=None)
    out = {"returncode": code, "seconds": round(time.perf_counter() - start, 1), "last_round": last,
           "val_acc": rounds[last].get("val_acc") if rounds else None, "auth": True}  # fmt: skip
    if code != 0 or not rounds:
        party_logs = {p.name: p.read_text(errors="replace")[-1200:] for p in sorted((folder / "logs").glob("*.log"))}
        out.update(launcher=(stdout + stderr)[-1500:], party_logs=party_logs)
        raise StepFailed(out, f"exit status {code}, {len(rounds)} server evaluations")
    where = f"device {check.gpu_opts[3]}" if check.cuda else "the CPU"
    out["summary"] = f"server + 2 clients (gRPC, authenticated) on {where}: 2 rounds, val acc {out['val_acc']:.3f}"
    return out


def run_group(argv: list[str], env: dict, cwd: Path, timeout: float) -> tuple[int | None, str, str]:
    """``(exit status or None on a timeout, stdout, stderr)`` of a command run in its own process group, which a
    timeout kills whole (a launcher's parties, a benchmark's children)."""
    proc = subprocess.Popen(argv, env=env, cwd=cwd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True)  # fmt: skip
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
        return proc.returncode, stdout, stderr
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        stdout, stderr = proc.communicate()
        return None, stdout, f"timed out after {timeout} s\n{stderr}"


def free_ports(n: int) -> list[int]:
    socks = [socket.socket() for _ in range(n)]
    for s in socks:
        s.bind(("127.0.0.1", 0))
    ports = [s.getsockname()[1] for s in socks]
    for s in socks:
        s.close()
    return ports


def bench(check: Check, script: str, *args: str) -> dict:
    """One benchmark script on the device; its closing lines (the ratios) are the result, the rest is in a log."""
    path = check.repo / "research" / "benchmarks" / script
    argv = [sys.executable, str(path), "--device", check.device, *args]
    start = time.perf_counter()
    code, stdout, stderr = run_group(argv, child_env(check.repo), path.parent, check.timeout)
    stem = script.removesuffix(".py") + ("_" + args[args.index("--dtype") + 1] if "--dtype" in args else "")
    (check.work / f"{stem}.log").write_text(stdout + stderr)
    lines = stdout.rstrip().splitlines()
    closing = lines[len(lines) - lines[::-1].index("") :] if "" in lines else lines[-5:]
    out = {"argv": argv[2:], "seconds": round(time.perf_counter() - start, 1), "output": stdout[-6000:],
           "ratios": closing}  # fmt: skip
    if code != 0:
        out["stderr"] = stderr[-2000:]
        raise StepFailed(out, f"exit status {code}" if code is not None else f"timed out after {check.timeout} s")
    return out


def step_reconstruct(check: Check) -> dict:
    out = bench(check, "bench_reconstruct.py", *(["--tiny", "--repeats", "2", "--dense-repeats", "1"] if check.tiny
                                                  else ["--repeats", "7", "--dense-repeats", "2"]))  # fmt: skip
    out["summary"] = "; ".join(x.split(";")[0] for x in out["ratios"][:2])
    return out


def step_adapter(check: Check) -> dict:
    sizes = ["--dim", "64", "--clients", "3", "--repeats", "2"] if check.tiny else ["--repeats", "11"]
    out = {}
    for dtype in ("float32", "float16"):
        out[dtype] = bench(check, "bench_adapter.py", *sizes, "--skip-accuracy", "--dtype", dtype)
    out["summary"] = "; ".join(f"{d}: {out[d]['ratios'][0].split(': ')[-1]}" for d in ("float32", "float16"))
    return out


def step_penalty(check: Check) -> dict:
    args = ["--tiny", "--repeats", "3", "--steps", "2", "--batch", "2", "--seq", "32"] if check.tiny else []
    out = bench(check, "bench_penalty.py", *args)
    out["summary"] = out["ratios"][-1]
    return out


def step_clients(check: Check) -> dict:
    args = (["--clients", "4", "8", "--sampled", "2", "--rounds", "2", "--hidden", "64", "--rank", "4",
             "--budget-mb", "1", "--records", "400"] if check.tiny
            else ["--clients", "10", "100", "--sampled", "10", "--rounds", "3", "--budget-mb", "64",
                  "--records", "5000"])  # fmt: skip
    out = bench(check, "bench_clients.py", *args)
    memory = [x for x in out["ratios"] if "device peak memory" in x]
    out["summary"] = "; ".join(memory) or out["ratios"][0]
    return out


def step_dp_sgd(check: Check) -> dict:
    glue, model = check.assets()
    sizes = ["--routines", "2", "--local-steps", "2", "--batch", "8", "--tok-len", "16", "--limit", "100"]
    out = bench(check, "bench_dp_sgd.py", "--data", glue, "--model", model, *(sizes if check.tiny else []))
    out["summary"] = "; ".join([x for x in out["ratios"] if x.strip().startswith("ratio ")][:2])
    return out


def step_paper_shapes(check: Check) -> dict:
    """research/benchmarks/bench_paper_shapes.py: the client step, the term and the server at RoBERTa-large's and
    Llama-3-8B's shapes beside the paper's tables; its JSON kept under the step (toy widths with --tiny)."""
    target = check.work / "paper_shapes.json"
    out = bench(check, "bench_paper_shapes.py", *(["--tiny"] if check.tiny else []), "--json", str(target))
    out["results"] = json.loads(target.read_text())
    goals = [x.strip() for x in out["output"].splitlines() if "(goal <=" in x]
    out["goals"] = goals
    out["summary"] = f"goal lines wholly met: {sum('NOT met' not in x for x in goals)} of {len(goals)}"
    return out


class StepFailed(Exception):
    """A step that ran and failed: ``result`` keeps what it measured."""

    def __init__(self, result: dict, message: str):
        super().__init__(message)
        self.result = result


RUNNERS: dict[str, Callable[[Check], dict]] = {name: globals()[f"step_{name}"] for name in STEPS}


# ---------------------------------------------------------------------------------------------------- main
def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="python -m research.tools.gpu_check", description=__doc__.splitlines()[0])
    parser.add_argument("--device", default=None, help="cuda, cuda:K or cpu (default: cuda when torch sees one)")
    parser.add_argument("--tiny", action="store_true", help="tiny sizes: a random BERT and synthetic SST-2")
    parser.add_argument("--only", nargs="+", choices=STEPS, metavar="STEP", help=f"some of: {' '.join(STEPS)}")
    parser.add_argument("--out", default="exp/gpu_check/gpu_check.json", help="the JSON written (after each step)")
    parser.add_argument("--work", default=None, help="scratch folder (default: beside --out)")
    parser.add_argument("--data", default=None, help="GLUE folder holding SST-2/ (not with --tiny)")
    parser.add_argument("--model", default=None, help=f"MiniLM folder, fp16 or fp32 (default: the {MINILM} package)")
    parser.add_argument("--step-timeout", type=cli.number(above=0), default=240.0,
                        help="seconds a child process may take")
    parser.add_argument("--repo", default=None, help="the fs_fedpa checkout (default: the working directory)")
    parser.add_argument("--prepare", metavar="DIR", help="write the carry folder for a GPU host and exit")
    parser.add_argument("--fs-source", default=None, help="with --prepare: FS's archive or checkout, as a wheel")
    parser.add_argument(
        "--train-lines",
        type=int,
        default=8000,
        help="with --prepare: SST-2 train lines kept (0: all, for the protocol's runs)",
    )
    args = parser.parse_args(argv)
    if args.prepare:
        prepare(Path(args.prepare), args.data, args.fs_source, args.train_lines)
        return 0
    args.repo = find_checkout(args.repo, NEEDS, "gpu_check")
    if args.device is None:
        import torch

        args.device = "cuda" if torch.cuda.is_available() else "cpu"
    if not (args.device == "cpu" or args.device.startswith("cuda")):
        parser.error(f"--device must be cpu, cuda or cuda:K (got {args.device!r})")
    out_path = Path(args.out)
    for flag, path in (("--out", out_path.parent), ("--work", Path(args.work) if args.work else None)):
        if path is not None and (blocked := cli.file_in_the_way(path)) is not None:
            parser.error(f"{flag} {path}: {blocked} is a file, not a folder")
    args.work = args.work or str(out_path.parent / "work")
    out_path.parent.mkdir(parents=True, exist_ok=True)
    check = Check(args)
    check.work.mkdir(parents=True, exist_ok=True)
    record: dict = {"device": args.device, "tiny": args.tiny, "command": sys.argv, "steps": {}}
    steps = ["env", *[s for s in STEPS if s in args.only and s != "env"]] if args.only else list(STEPS)
    print(f"[gpu_check] {len(steps)} steps on {args.device}{' (tiny)' if args.tiny else ''}; JSON: {out_path}")
    for name in steps:
        start = time.perf_counter()
        try:
            result, status = RUNNERS[name](check), "ok"
        except Skip as exc:
            result, status = {"summary": str(exc)}, "skipped"
        except StepFailed as exc:
            result, status = {**exc.result, "summary": str(exc)}, "FAILED"
        except Exception as exc:  # one step's fault must not stop the rest
            result, status = {"summary": f"{type(exc).__name__}: {exc}"}, "FAILED"
        result.update(status=status, wall_s=round(time.perf_counter() - start, 1))
        record["steps"][name] = result
        print(f"[gpu_check] {name:12s} {status:8s} {result['wall_s']:7.1f} s  {result.get('summary', '')}",
              flush=True)  # fmt: skip
        out_path.write_text(json.dumps(record, indent=1, default=str))
    print(table(record))
    return 0 if all(s["status"] != "FAILED" for s in record["steps"].values()) else 1


def table(record: dict) -> str:
    rows = [f"\n{'step':12s} {'status':8s} {'seconds':>8s}  result", "-" * 100]
    for name, s in record["steps"].items():
        rows.append(f"{name:12s} {s['status']:8s} {s['wall_s']:8.1f}  {s.get('summary', '')}")
    return "\n".join(rows)


if __name__ == "__main__":
    sys.exit(cli.one_line_errors(main, "gpu_check")())
