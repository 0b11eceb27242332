"""FedPA-LoRA's client and server costs at the paper's two shapes, side by side, beside the paper's wall-clock tables.

Shapes (the paper's homogeneous-rank setting, Appendix "Server-/Client-Side Wall-Clock Evaluation"):
  roberta-large: LoRA on query and value of all 24 layers, 48 modules, d = k = 1024, r = R_i = 4, N = 10, R_g = 4;
  llama-3-8b:    LoRA on q_proj (4096 x 4096) and v_proj (1024 out x 4096 in) of all 32 layers, 64 modules,
                 r = R_i = 8, N = 6, R_g = 8.

Measured, per shape, float32, on one device (--device), each part's variants timed round-robin in one loop
(_common.interleaved_times: median of the repeats, a slow spell of the machine hits every variant alike):

1. The alignment term alone over every module of the adapter (factors only, no model), forward + backward:
   old: lam/2 * sum of fs_fedpa.core.penalty.product_penalty per module, through autograd;
   new: fs_fedpa.core.batched_penalty.ProductTerm (modules batched by shape, gradient in closed form);
   products: the bare batched products its closed form needs (8 bmm a shape group, on pre-stacked tensors).
   The term is timed on top of a task stub that gives every factor a gradient (sum of B.sum() + A.sum()), as in
   training (gradients reset to None before each step), minus the stub alone; the term alone without a stub is
   timed too. aten operator calls per step (torch.profiler, nested included): step with the term minus the stub
   alone, for the whole adapter and for each shape group of the new path.
2. A client step of a randomly initialised model built from a config (no weights), PEFT LoRA on the paper's
   modules, AdamW: plain (forward, loss, backward, step); the same plus the alignment term toward a random
   rank-R_i reference (new path and old path); a DP-SGD step (per-example gradients of the LoRA factors from the
   project's taps, fs_fedpa.privacy.per_example, on the whole batch; clipped; Gaussian noise; AdamW step).
   Llama-3-8B is depth-reduced (1 layer and a 32,000 vocabulary on a CPU; 4 layers and the full vocabulary on a
   GPU): its step covers that many layers' modules, and the term on all 64 modules is item 1's.
3. The server over the N clients' uploads of every module: fs_fedpa.core.reconstruct.reconstruct_adapter in modes
   "reduced", "randomized" (oversample 8: sketch l = R_g + 8) and "dense" (the (d, k) aggregate's SVD; slow on
   a CPU: timed once on the first layers only and scaled linearly to all layers), and two-factor averaging (FedIT).

The paper's numbers (Table tab:client_wallclock, seconds per client and round; Table tab:server_wallclock, seconds
per round) are printed beside ours. The paper's client table gives seconds a round; a step's figure divides it by
the local steps of the repo's paper configs (yaml_configs/fedpa_sst2.yaml: 20, yaml_configs/fedpa_gsm8k_llama3.yaml:
30), an assumption, not the paper's statement.

    python research/benchmarks/bench_paper_shapes.py [--device cuda] [--json FILE] [--repeats N] [--quick]
        [--threads T] [--micro-repeats N] [--shapes roberta-large llama-3-8b] [--llama-layers L] [--llama-vocab V]
        [--{roberta,llama}-{batch,seq,dense-layers} N]

On a CPU, timings of the batched term move with other jobs on the machine (see --threads). The default run took 87 s
on 2 idle cores (docs/reference/paper_shapes/cpu.txt); --quick took 43 s to 4 minutes on 2 cores shared with other
jobs; --tiny about 5 s.
"""

from __future__ import annotations

import argparse
import gc
import json
import math
import os
import time
import warnings

import torch
from _common import client_factors, fmt, interleaved_times, median_time
from torch import nn
from paper_client_step import client_step
from paper_shapes_common import (LAM, MODELS, PAPER, SHAPES, T0, TINY_MODELS, TINY_SHAPES, aten_calls, factor_steps,
                                 make_factors, module_names, ms, ratio, say)  # fmt: skip


def term_alone(spec: dict, device: str, repeats: int) -> dict:
    """Item 1: the term over all modules of the adapter, factors only."""
    from fs_fedpa.core.batched_penalty import ProductTerm

    live, reference = make_factors(spec, device)
    term = ProductTerm(live, reference)
    fns = factor_steps(live, reference, term)

    # (c) the bare batched products, per shape group, on pre-stacked copies
    shapes: dict[tuple, list[str]] = {}
    for n, (B, A) in live.items():
        shapes.setdefault((*B.shape, A.shape[1], reference[n][0].shape[1]), []).append(n)
    stacks = []
    for names in shapes.values():
        with torch.no_grad():
            stacks.append(tuple(torch.stack([x.detach() for x in xs]) for xs in (
                [live[n][0] for n in names], [live[n][1] for n in names],
                [reference[n][0] for n in names], [reference[n][1] for n in names])))  # fmt: skip

    def products():
        for B, A, B_r, A_r in stacks:
            AAt, AArt = torch.bmm(A, A.mT), torch.bmm(A, A_r.mT)
            BtB, BtBr = torch.bmm(B.mT, B), torch.bmm(B.mT, B_r)
            torch.bmm(B, AAt), torch.bmm(B_r, AArt.mT), torch.bmm(BtB, A), torch.bmm(BtBr, A_r)

    t = interleaved_times({**fns, "products": products}, repeats, warmup=3)
    calls = {k: aten_calls(fns[k]) for k in ("stub", "stub+new", "stub+old")}
    term.release()
    out = {
        "modules": len(live),
        "term_alone_ms": (t["stub+new"] - t["stub"]) * 1e3,
        "term_alone_ms_old": (t["stub+old"] - t["stub"]) * 1e3,
        "term_only_ms": t["new"] * 1e3,
        "term_only_ms_old": t["old"] * 1e3,
        "stub_ms": t["stub"] * 1e3,
        "products_ms": t["products"] * 1e3,
        "term_ops_per_step": calls["stub+new"] - calls["stub"],
        "term_ops_per_step_old": calls["stub+old"] - calls["stub"],
        "groups": [],
    }
    # operator calls of each shape group alone (its own parameters and term)
    for (d, r, k, R), names in shapes.items():
        g_live = {n: (nn.Parameter(live[n][0].detach().clone()), nn.Parameter(live[n][1].detach().clone()))
                  for n in names}  # fmt: skip
        g_ref = {n: reference[n] for n in names}
        g_term = ProductTerm(g_live, g_ref)
        g_fns = factor_steps(g_live, g_ref, g_term)
        g_fns["stub"](), g_fns["stub+new"](), g_fns["stub+old"]()
        c = {k: aten_calls(g_fns[k]) for k in ("stub", "stub+new", "stub+old")}
        g_term.release()
        out["groups"].append({"d": d, "k": k, "r": r, "R": R, "modules": len(names),
                              "term_ops_per_step": c["stub+new"] - c["stub"],
                              "term_ops_per_step_old": c["stub+old"] - c["stub"]})  # fmt: skip
    return out


def server(spec: dict, device: str, repeats: int, dense_layers: int) -> dict:
    """Item 3: reconstruct_adapter (reduced, randomized, dense) and two-factor averaging over N uploads."""
    from fs_fedpa.core.reconstruct import reconstruct_adapter

    N, r, R_g = spec["N"], spec["r"], spec["R_g"]
    names = module_names(spec)
    uploads: list[dict] = [{} for _ in range(N)]
    for j, (name, (d, k)) in enumerate(names.items()):
        Bs, As = client_factors(N, d, k, r, seed=j)
        for i in range(N):
            uploads[i][name] = (Bs[i].to(device), As[i].to(device))
    gen = torch.Generator(device=device).manual_seed(0)

    def averaging():
        return {n: (torch.stack([u[n][0] for u in uploads]).mean(0), torch.stack([u[n][1] for u in uploads]).mean(0))
                for n in names}  # fmt: skip

    fns = {
        "averaging": averaging,
        "reduced": lambda: reconstruct_adapter(uploads, R_g, weights=None, mode="reduced"),
        "randomized": lambda: reconstruct_adapter(uploads, R_g, weights=None, mode="randomized", generator=gen),
    }
    t = interleaved_times(fns, repeats, warmup=2)
    out = {
        "averaging_ms": t["averaging"] * 1e3,
        "reconstruct_ms": t["reduced"] * 1e3,
        "randomized_ms": t["randomized"] * 1e3,
        "randomized_sketch": min(R_g + 8, N * r),
        "N": N,
        "R_g": R_g,
    }
    if dense_layers > 0:
        sub = list(module_names(spec, dense_layers))
        part = [{n: u[n] for n in sub} for u in uploads]
        dense_repeats = 1 if len(sub) < len(names) or not device.startswith("cuda") else 3
        measured = median_time(lambda: reconstruct_adapter(part, R_g, weights=None, mode="dense"),
                               repeats=dense_repeats, warmup=0) * 1e3  # fmt: skip
        out["dense_ms"] = measured * len(names) / len(sub)
        out["dense_ms_scaled_from"] = {"layers": dense_layers, "modules": len(sub), "measured_ms": measured,
                                       "repeats": dense_repeats, "scale": len(names) / len(sub)}  # fmt: skip
    else:
        out["dense_ms"] = None
        out["dense_ms_scaled_from"] = "skipped (--dense-layers 0)"
    return out


def settings(shape: str, args) -> dict:
    """Depth, vocabulary, batch, sequence length and the dense subset for ``shape`` on this device."""
    cuda = args.device.startswith("cuda")
    if args.tiny:
        s = {"layers": 2, "vocab": 100, "batch": 2, "seq": 16, "dense_layers": 2}
    elif shape == "roberta-large":
        s = {"layers": 24, "vocab": 50265}
        if cuda:
            s.update(batch=32 if args.quick else 128, seq=128)  # 128 x 128: yaml_configs/fedpa_sst2.yaml
        else:
            s.update(batch=1 if args.quick else 4, seq=32 if args.quick else 64)
        s["dense_layers"] = 24 if cuda or not args.quick else 1
    else:
        if cuda:
            s = {"layers": 2 if args.quick else 4, "vocab": 128256, "batch": 1, "seq": 256 if args.quick else 1000}
            s["dense_layers"] = 1 if args.quick else 4
        else:
            s = {"layers": 1, "vocab": 8000 if args.quick else 32000, "batch": 1, "seq": 64 if args.quick else 128}
            s["dense_layers"] = 0 if args.quick else 1
    for key in ("layers", "vocab", "batch", "seq", "dense_layers"):
        value = getattr(args, f"{'roberta' if shape == 'roberta-large' else 'llama'}_{key}")
        if value is not None:
            s[key] = value
    return s


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu", help="cpu or cuda")
    parser.add_argument("--json", help="write the results to this file")
    parser.add_argument("--repeats", type=int, help="timed client steps of each kind (default 5; cuda 20; quick 2)")
    parser.add_argument("--micro-repeats", type=int, help="repeats of the factor-only and server timings "
                        "(default 30; quick 10)")  # fmt: skip
    parser.add_argument("--quick", action="store_true", help="smaller batches, fewer repeats: a smoke check")
    parser.add_argument("--tiny", action="store_true", help="the two layouts at toy widths, 2 repeats: checks that "
                        "the script runs, not the goals")  # fmt: skip
    parser.add_argument("--threads", type=int, help="torch.set_num_threads (default: torch's). On a CPU shared with "
                        "other jobs, 2 threads' batched products wait for a descheduled thread (0.6 -> 45 ms for "
                        "RoBERTa-large's 8 bmm): 1 thread gives steadier term timings")  # fmt: skip
    parser.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    for prefix in ("roberta", "llama"):
        for key in ("layers", "vocab", "batch", "seq"):
            parser.add_argument(f"--{prefix}-{key}", type=int, help=f"{prefix} model's {key} (default: by device)")
        parser.add_argument(f"--{prefix}-dense-layers", type=int,
                            help="dense SVD timed on the first L layers' modules, scaled to all (0: skip)")
    args = parser.parse_args()
    dev = args.device
    cuda = dev.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        parser.error("--device cuda but torch sees no GPU")
    if args.threads:
        torch.set_num_threads(args.threads)
    repeats = args.repeats or (2 if args.quick or args.tiny else 20 if cuda else 5)
    micro = args.micro_repeats or (2 if args.tiny else 10 if args.quick else 30)
    shapes, widths = (TINY_SHAPES, TINY_MODELS) if args.tiny else (SHAPES, MODELS)
    torch.manual_seed(0)
    warnings.filterwarnings("ignore", category=FutureWarning)  # transformers' deprecation notices
    load = os.getloadavg()[0] if hasattr(os, "getloadavg") else None
    device_name = torch.cuda.get_device_name(dev) if cuda else f"cpu, {torch.get_num_threads()} threads"
    say(f"device {device_name}, torch {torch.__version__}, float32, steps x{repeats}, micro x{micro}"
        f"{', --quick' if args.quick else ''}; load average {load:.1f} at the start")  # fmt: skip

    results: dict[str, dict] = {}
    for shape in args.shapes:
        spec, s = shapes[shape], settings(shape, args)
        res = {"device": dev, "r": spec["r"], "R_i": spec["R_i"], "lam": LAM}
        say(f"{shape}{' (tiny)' if args.tiny else ''}: (1) the term alone over all {len(module_names(spec))} modules, factors only")
        res.update(term_alone(spec, dev, micro))
        say(f"{shape}:     new {fmt(res['term_alone_ms'] / 1e3)}, old {fmt(res['term_alone_ms_old'] / 1e3)}, "
            f"products {fmt(res['products_ms'] / 1e3)}; aten calls new {res['term_ops_per_step']}, "
            f"old {res['term_ops_per_step_old']}")  # fmt: skip
        say(f"{shape}: (2) client step, {s['layers']} of {spec['layers']} layers, vocab {s['vocab']}, "
            f"batch {s['batch']} x {s['seq']} tokens")  # fmt: skip
        res.update(client_step(shape, spec, dev, s["layers"], s["vocab"], s["batch"], s["seq"], repeats,
                               widths[shape]))  # fmt: skip
        say(f"{shape}:     plain {res['step_ms']:.1f} ms, term {res['step_term_ms']:.1f} ms, "
            f"old term {res['step_term_old_ms']:.1f} ms, DP-SGD {ms(res['step_dp_ms']).strip()} ms")  # fmt: skip
        say(f"{shape}: (3) server, N = {spec['N']}, R_g = {spec['R_g']}, dense on {s['dense_layers']} layer(s)")
        res.update(server(spec, dev, micro, s["dense_layers"]))
        say(f"{shape}:     averaging {res['averaging_ms']:.2f} ms, reduced {res['reconstruct_ms']:.2f} ms, "
            f"randomized {res['randomized_ms']:.2f} ms, dense {ms(res['dense_ms']).strip()} ms")  # fmt: skip
        res["paper"] = PAPER[shape]
        results[shape] = res
        gc.collect()

    # ---- the client table
    print()
    print(f"CLIENT STEP, ms a step, median of {repeats} (ours: {device_name}; the paper: Table tab:client_wallclock, "
          "s a round / local steps)")  # fmt: skip
    head = (f"  {'':34s} {'plain':>10s} {'+term':>10s} {'+old term':>10s} {'DP-SGD':>10s} {'term':>9s} "
            f"{'term %':>8s} {'old term':>9s} {'old %':>8s} {'DP/plain':>9s}")  # fmt: skip
    print(head)
    for shape, res in results.items():
        spec, p = shapes[shape], PAPER[shape]["client"]
        where = f"{res['layers']}/{spec['layers']} layers, {res['batch']}x{res['seq']}"
        if res["vocab"] != (50265 if shape == "roberta-large" else 128256):
            where += f", vocab {res['vocab']}"
        print(f"  {shape + ' (' + where + ')':34s} {ms(res['step_ms'])} {ms(res['step_term_ms'])} "
              f"{ms(res['step_term_old_ms'])} {ms(res['step_dp_ms'])} {res['term_ms']:9.2f} "
              f"{100 * res['term_ms'] / res['step_ms']:+7.2f}% {res['term_old_ms']:9.2f} "
              f"{100 * res['term_old_ms'] / res['step_ms']:+7.2f}% "
              f"{ratio(res['step_dp_ms'], res['step_ms']):>9s}")  # fmt: skip
        n = spec["local_steps"]
        full, fedpa = p["full"] * 1e3 / n, p["fedpa"] * 1e3 / n
        print(f"  {'  paper (/' + str(n) + ' steps, its GPU)':34s} {ms(full)} {ms(fedpa)} {'':10s} {'':>10s} "
              f"{fedpa - full:9.2f} {100 * (fedpa / full - 1):+7.2f}%")  # fmt: skip
        print(f"  {'  term alone, all ' + str(res['modules']) + ' modules':34s} new {res['term_alone_ms']:.3f} ms "
              f"(without a task stub {res['term_only_ms']:.3f} ms), old {res['term_alone_ms_old']:.3f} ms, "
              f"products alone {res['products_ms']:.3f} ms; aten calls a step new {res['term_ops_per_step']}, "
              f"old {res['term_ops_per_step_old']} "
              f"({res['term_ops_per_step_old'] / res['modules']:.0f} a module)")  # fmt: skip
        for g in res["groups"]:
            print(f"  {'':34s}   group d={g['d']} k={g['k']} r={g['r']} R={g['R']}: {g['modules']} modules, "
                  f"aten calls new {g['term_ops_per_step']}, old {g['term_ops_per_step_old']}")  # fmt: skip
        if res["model_modules"] < res["modules"]:
            print(f"  {'':34s}   (the model above is depth-reduced: its step holds {res['model_modules']} of "
                  f"{res['modules']} modules; the whole adapter's term is the line above)")  # fmt: skip
        print(f"  {'':34s}   DP-SGD: {res['dp_check']}")
    print("  term, term %: step with the term (new ProductTerm) - plain step; old: per-module product_penalty through "
          "autograd. DP-SGD: the project's taps (fs_fedpa.privacy.per_example) on the whole batch, clip 1, noise "
          "z = 1 (seeded MT19937), LoRA factors only; the paper has no DP-SGD row.")  # fmt: skip

    # ---- the server table
    print()
    print(f"SERVER, ms a round over all modules, median of {micro} (ours: {device_name}; the paper: Table "
          "tab:server_wallclock)")  # fmt: skip
    print(f"  {'':26s} {'averaging':>10s} {'reduced':>10s} {'randomized':>10s} {'dense SVD':>12s} "
          f"{'red/avg':>8s} {'rand/avg':>8s} {'dense/avg':>10s}")  # fmt: skip
    for shape, res in results.items():
        p = PAPER[shape]["server"]
        dense = res["dense_ms"]
        print(f"  {shape + ' (ours)':26s} {ms(res['averaging_ms'])} {ms(res['reconstruct_ms'])} "
              f"{ms(res['randomized_ms'])} {ms(dense):>12s} {ratio(res['reconstruct_ms'], res['averaging_ms'])} "
              f"{ratio(res['randomized_ms'], res['averaging_ms'])} "
              f"{ratio(dense, res['averaging_ms']):>10s}")  # fmt: skip
        print(f"  {shape + ' (paper)':26s} {ms(p['averaging'] * 1e3)} {ms(p['reduced'] * 1e3)} "
              f"{ms(p['randomized'] * 1e3)} {ms(p['dense'] * 1e3):>12s} {ratio(p['reduced'], p['averaging'])} "
              f"{ratio(p['randomized'], p['averaging'])} {ratio(p['dense'], p['averaging']):>10s}")  # fmt: skip
        scaled = res["dense_ms_scaled_from"]
        if isinstance(scaled, dict) and scaled["scale"] != 1:
            print(f"  {'':26s}   dense: measured once on the first {scaled['layers']} layer(s) ({scaled['modules']} "
                  f"modules, {scaled['measured_ms']:.0f} ms), scaled x{scaled['scale']:.0f} to all "
                  "modules")  # fmt: skip
        elif not isinstance(scaled, dict):
            print(f"  {'':26s}   dense: {scaled}")
    print("  randomized: sketch l = R_g + 8 (the paper's p = 8 row); averaging: FedIT's mean of the Bs and of the As.")

    # ---- goals (reported, not asserted)
    print()
    print(f"goal checks ({dev}):")
    for shape, res in results.items():
        worst = max(g["term_ops_per_step"] for g in res["groups"])
        print(f"  {shape}: term aten calls a step per shape group {worst} (goal <= 64): "
              f"{'met' if worst <= 64 else 'NOT met'}")  # fmt: skip
    if "llama-3-8b" in results:
        res = results["llama-3-8b"]
        q = res["term_alone_ms"] / res["products_ms"]
        tag = "" if not cuda else " (a CPU goal; measured on cuda)"
        print(f"  llama-3-8b: term alone / products alone = {q:.2f}x (goal <= 2x on a CPU){tag}: "
              f"{'met' if q <= 2 else 'NOT met'}")  # fmt: skip
    for shape, res in results.items():
        q = res["step_term_ms"] / res["step_ms"]
        held, total = res["model_modules"], res["modules"]
        part = f" ({held} of {total} modules)" if held < total else ""
        print(f"  {shape}: step with term / without = {q:.3f}{part} (goal <= 1.02): "
              f"{'met' if q <= 1.02 else 'NOT met'}")
    tag = "" if cuda else " (GPU goals; measured on cpu)"
    for shape, res in results.items():
        share = res["term_ms"] / res["step_ms"]
        rec = res["reconstruct_ms"] / res["averaging_ms"]
        dpq = res["step_dp_ms"] / res["step_ms"] if res["step_dp_ms"] is not None else math.nan
        whole = ""
        if res["model_modules"] < res["modules"]:  # depth-reduced: the whole adapter's term from item 1
            whole = (f" (the model holds {res['model_modules']} of {res['modules']} modules; the term alone on all "
                     f"{res['modules']} is {100 * res['term_alone_ms'] / res['step_ms']:.2f}% of this step)")
        print(f"  {shape}{tag}: term {100 * share:.2f}% of the step{whole} (goal <= 1%): "
              f"{'met' if share <= 0.01 else 'NOT met'}; "
              f"reconstruct {rec:.2f}x averaging (goal <= 3x): {'met' if rec <= 3 else 'NOT met'}; "
              + (f"DP step {dpq:.2f}x plain (goal <= 1.2x): {'met' if dpq <= 1.2 else 'NOT met'}"
                 if math.isfinite(dpq) else "DP step: skipped"))  # fmt: skip

    if args.json:
        doc = {"device": device_name, "torch": torch.__version__, "threads": torch.get_num_threads(),
               "quick": args.quick, "load_average_at_start": load, "seconds": round(time.perf_counter() - T0, 1),
               "shapes": {k: {kk: (None if isinstance(v, float) and not math.isfinite(v) else v)
                              for kk, v in res.items()} for k, res in results.items()}}  # fmt: skip
        with open(args.json, "w") as f:
            json.dump(doc, f, indent=1)
        print(f"\nwrote {args.json}")
    say("done")


if __name__ == "__main__":
    main()
