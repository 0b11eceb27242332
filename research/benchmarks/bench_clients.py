"""Many clients, K sampled a round, adapters of several MB: time and memory of FedPA-LoRA and FedIT as N grows.

Each (N, method) runs stock FS standalone in a fresh child process on the tiny Llama made wide enough that one
client's adapter (r on every linear layer) is at least 5 MB, with ``fedpa.store.state_budget_mb`` bounding the clients'
states in host memory. The child times FS's setup, every training round (broadcast to the next broadcast) and the
final evaluation round (all N clients), and reads its peak RSS and the state store's bytes. Goals (issue "many
clients"): a training round at N = 1000 within 1.1x of N = 10; peak RSS at N = 1000 within the budget plus K
clients' states plus what N = 10 needs; FedPA-LoRA's round within 1.05x FedIT's; an evaluation round growing with N
only by a per-client overhead (printed in ms per client).

    python research/benchmarks/bench_clients.py [--clients 10 100 1000] [--sampled 10] [--rounds 6] [--budget-mb 64]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def child(
    n: int, k: int, rounds: int, method: str, budget_mb: float, work: Path, lam: float = 0.01, device: str = "cpu",
    hidden: int = 256, r: int = 64, records: int = 20_000,
) -> dict:  # fmt: skip
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "research" / "benchmarks"))
    from _common import fs_runner

    from fs_fedpa.plugin import client_state
    from fs_fedpa.plugin import server as server_mod
    from fs_fedpa.tools.tiny_llm import build_tiny_llama, write_instruction_jsonl
    from tests.integration.tiny_assets import dump_yaml, fs_llm_yaml

    data, texts = write_instruction_jsonl(work / "data.jsonl", records)
    model = build_tiny_llama(work / "wide_llama", texts, hidden=hidden, layers=5, heads=4, intermediate=2 * hidden)
    import torch

    cuda = device.startswith("cuda")
    index = (torch.device(device).index or 0) if cuda else -1
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj"]
    cfg_dict = fs_llm_yaml(work, model, data, **{
        "federate.method": method, "federate.client_num": n, "federate.sample_client_num": k,
        "federate.total_round_num": rounds, "federate.share_local_model": True, "eval.freq": rounds,
        "use_gpu": cuda, "device": index,
        "llm.adapter.args": [{"adapter_package": "peft", "adapter_method": "lora", "r": r, "lora_alpha": 2 * r,
                              "lora_dropout": 0.0, "target_modules": targets}],
        "fedpa.store.state_budget_mb": budget_mb, "fedpa.lam": lam, "fedpa.records.diagnostics": "off",
        "train.local_update_steps": 2, "expname": f"{method}_{n}", "data.splitter": "iid",
        "data.splits": [0.98, 0.01, 0.01], "eval.split": ["val"],
    })  # fmt: skip
    cfg_file = dump_yaml(cfg_dict, work / "cfg.yaml")
    start = time.perf_counter()
    runner = fs_runner(cfg_file)
    setup = time.perf_counter() - start
    marks: list[tuple[str, float]] = []
    disk = [0]
    broadcast = server_mod.FedPAServer.broadcast_model_para

    def timed(self, msg_type="model_para", *args, **kwargs):
        marks.append((msg_type, time.perf_counter()))
        store = next(iter(client_state._STORES.values()), None)
        if store is not None:
            disk[0] = max(disk[0], store.disk_bytes)
        return broadcast(self, msg_type, *args, **kwargs)

    server_mod.FedPAServer.broadcast_model_para = timed
    aggregate, spent = server_mod.FedPAAggregator.aggregate, []

    def timed_aggregate(self, agg_info):
        begin = time.perf_counter()
        try:
            return aggregate(self, agg_info)
        finally:
            spent.append(time.perf_counter() - begin)

    server_mod.FedPAAggregator.aggregate = timed_aggregate
    runner.run()
    store = next(iter(client_state._STORES.values()))
    end = time.perf_counter()
    marks.append(("end", end))
    train = [b - a for (kind, a), (_, b) in zip(marks, marks[1:]) if kind == "model_para"]
    evals = [b - a for (kind, a), (_, b) in zip(marks, marks[1:]) if kind == "evaluate"]
    any_client = next(iter(runner.client.values()))
    adapter = sum(p.numel() * p.element_size() for n_, p in any_client.model.named_parameters() if "lora_" in n_)
    return {
        "setup_s": setup, "train_round_s": sum(train[1:]) / max(1, len(train) - 1) if len(train) > 1 else train[0],
        "eval_round_s": evals[-1] if evals else float("nan"),
        "peak_rss_mb": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024,
        "device_peak_mb": torch.cuda.max_memory_allocated(index) / 2**20 if cuda else float("nan"),
        "state_peak_mb": store.peak_bytes / 2**20, "state_disk_mb": disk[0] / 2**20,
        "adapter_mb": adapter / 2**20, "aggregate_s": sum(spent) / max(1, len(spent)),
    }  # fmt: skip


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--clients", type=int, nargs="+", default=[10, 100, 1000])
    parser.add_argument("--sampled", type=int, default=10)
    parser.add_argument("--rounds", type=int, default=6)  # several, so that sampled clients rotate
    parser.add_argument("--budget-mb", type=float, default=64.0)
    parser.add_argument("--methods", nargs="+", default=["fedit", "fedpa"])
    parser.add_argument("--lam", type=float, default=0.01, help="FedPA-LoRA's lambda (0: no alignment term)")
    parser.add_argument("--device", default="cpu", help="cpu or cuda[:k]: where every party trains (FS use_gpu)")
    parser.add_argument("--hidden", type=int, default=256, help="the wide tiny Llama's hidden size")
    parser.add_argument("--rank", type=int, default=64, help="LoRA r on every linear layer")
    parser.add_argument("--records", type=int, default=20_000, help="instruction records split among the N clients")
    parser.add_argument("--child", nargs=2, metavar=("N", "METHOD"))
    args = parser.parse_args()
    if args.child:
        with tempfile.TemporaryDirectory() as work:
            n, method = int(args.child[0]), args.child[1]
            out = child(n, args.sampled, args.rounds, method, args.budget_mb, Path(work), args.lam, args.device,
                        args.hidden, args.rank, args.records)  # fmt: skip
        print("BENCH " + json.dumps(out), flush=True)
        return
    env = dict(os.environ, PYTHONWARNINGS="ignore", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false",
               PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))  # fmt: skip
    rows = {}
    for n in args.clients:
        for method in args.methods:  # side by side for each N, in one run of this script
            cmd = [sys.executable, __file__, "--child", str(n), method, "--sampled", str(args.sampled),
                   "--rounds", str(args.rounds), "--budget-mb", str(args.budget_mb),
                   "--lam", str(args.lam), "--device", args.device, "--hidden", str(args.hidden),
                   "--rank", str(args.rank), "--records", str(args.records)]  # fmt: skip
            proc = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=ROOT)
            line = next((x for x in proc.stdout.splitlines() if x.startswith("BENCH ")), None)
            if proc.returncode != 0 or line is None:
                sys.exit(f"N={n} {method} failed:\n{proc.stderr[-3000:]}")
            rows[(n, method)] = json.loads(line[len("BENCH ") :])
            r = rows[(n, method)]
            print(f"N={n:5d} {method:6s} setup {r['setup_s']:7.1f} s | train round {r['train_round_s']:6.2f} s | "
                  f"eval round {r['eval_round_s']:7.2f} s | peak RSS {r['peak_rss_mb']:7.0f} MiB | client state "
                  f"{r['state_peak_mb']:6.1f} MiB in memory (peak), {r['state_disk_mb']:6.1f} MiB on disk (max) | "
                  f"adapter {r['adapter_mb']:.2f} MiB | server aggregation {r['aggregate_s']:.2f} s a round | "
                  f"device peak {r['device_peak_mb']:.0f} MiB",
                  flush=True)  # fmt: skip
    small, large = min(args.clients), max(args.clients)
    print(f"\nbudget {args.budget_mb:g} MiB, K = {args.sampled}, {args.rounds} rounds")
    for method in args.methods:
        a, b = rows[(small, method)], rows[(large, method)]
        per_client = (b["eval_round_s"] - a["eval_round_s"]) / max(1, large - small) * 1e3
        k_states = args.sampled * b["adapter_mb"]
        allowed = args.budget_mb + k_states + a["peak_rss_mb"]
        ratio = b["train_round_s"] / a["train_round_s"]
        print(f"{method}: train round N={large} / N={small}: {ratio:.3f} (goal <= 1.1); "
              f"peak RSS N={large}: {b['peak_rss_mb']:.0f} MiB vs budget + K states + N={small} = {allowed:.0f} MiB; "
              f"evaluation: {per_client:.1f} ms per client")  # fmt: skip
        if args.device != "cpu":
            growth = b["device_peak_mb"] / a["device_peak_mb"]
            print(f"{method}: device peak memory N={large} / N={small}: {growth:.3f} "
                  f"({b['device_peak_mb']:.0f} vs {a['device_peak_mb']:.0f} MiB; goal: no growth with N)")  # fmt: skip
    if "fedpa" in args.methods and "fedit" in args.methods:
        ratios = ", ".join(f"N={n}: {rows[(n, 'fedpa')]['train_round_s'] / rows[(n, 'fedit')]['train_round_s']:.3f}"
                           for n in args.clients)  # fmt: skip
        print(f"FedPA-LoRA / FedIT training round: {ratios} (goal <= 1.05)")
        parts = []
        for n in args.clients:
            ours, fedit = rows[(n, "fedpa")], rows[(n, "fedit")]
            clients_part = (ours["train_round_s"] - ours["aggregate_s"]) / (
                fedit["train_round_s"] - fedit["aggregate_s"]
            )
            parts.append(f"N={n}: {clients_part:.3f}")
        local = ", ".join(parts)
        print(f"the same without the server's aggregation (the clients' part of a round): {local}")


if __name__ == "__main__":
    main()
