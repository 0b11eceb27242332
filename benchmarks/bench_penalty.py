"""Client-side cost of the alignment term: factored penalty vs the dense-product penalty, and a training step.

(a) forward + backward of product_penalty (Gram form) vs ((B A - B_ref A_ref)^2).sum() (what the authors'
    code computes at every local step), at RoBERTa-large (d=k=1024, r=R=4) and Llama-3-8B-like
    (d=k=4096, r=R=8) shapes. Goal: >= 10x faster.
(b) one AdamW training step of a small random Llama (hidden 1024, 4 layers, LoRA r=8 on q_proj, v_proj,
    batch 4 x 128 tokens) with and without lam/2 * sum of product penalties toward a fixed rank-8
    reference (FedPA's alignment as the client computes it). Steps alternate with/without so that drift
    in the machine's speed hits both alike. Goal: with/without <= 1.05.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from _common import fmt, median_time

from fs_fedpa import product_penalty


def penalty_case(d: int, r: int, repeats: int) -> tuple[float, float]:
    g = torch.Generator().manual_seed(d)
    B = (torch.randn(d, r, generator=g) * 0.01).requires_grad_()
    A = (torch.randn(r, d, generator=g) / d**0.5).requires_grad_()
    B_ref, A_ref = torch.randn(d, r, generator=g) * 0.01, torch.randn(r, d, generator=g) / d**0.5

    def factored():
        product_penalty(B, A, B_ref, A_ref).backward()

    def dense():
        (B @ A - B_ref @ A_ref).pow(2).sum().backward()

    return median_time(factored, repeats), median_time(dense, repeats)


def training_step_ratio(steps: int, batch: int, seq: int) -> tuple[float, float]:
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from fs_fedpa import lora
    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.core.ranks import RankPlan
    from fs_fedpa.methods.fedpa import FedPA

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=1024,
        intermediate_size=2816,
        num_hidden_layers=4,
        num_attention_heads=16,
        num_key_value_heads=16,
        max_position_embeddings=seq,
    )
    model = peft.get_peft_model(
        LlamaForCausalLM(config), peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    )
    live = lora.get_factors(model)
    reference = {n: (torch.randn_like(B) * 0.01, torch.randn_like(A) * 0.03) for n, (B, A) in live.items()}
    method = FedPA(FedPAConfig(lam=1.0), RankPlan.build(1, 8))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.randint(0, 8000, (batch, seq))

    def step(with_penalty: bool) -> float:
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        if with_penalty:
            loss = loss + method.alignment(live, reference, 1.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        return time.perf_counter() - start

    step(True), step(False)  # warm-up
    times = {True: [], False: []}
    for i in range(2 * steps):
        flag = i % 2 == 0
        times[flag].append(step(flag))
    return statistics.median(times[True]), statistics.median(times[False])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--seq", type=int, default=128)
    args = parser.parse_args()
    print(f"\n(a) penalty forward+backward, float32, {torch.get_num_threads()} threads")
    ratios = {}
    for d, r in ((1024, 4), (4096, 8)):
        t_fact, t_dense = penalty_case(d, r, args.repeats)
        ratios[(d, r)] = t_dense / t_fact
        print(f"  d=k={d}, r=R={r}: factored {fmt(t_fact)}   dense product {fmt(t_dense)}")
    print(f"\n(b) training step, Llama hidden 1024 x 4 layers, LoRA r=8 on q,v, batch {args.batch} x {args.seq}")
    with_p, without_p = training_step_ratio(args.steps, args.batch, args.seq)
    print(f"  with penalty {fmt(with_p)}   without {fmt(without_p)}")
    print()
    for (d, r), ratio in ratios.items():
        print(f"speedup dense-product penalty / factored penalty @ d={d},r={r}: {ratio:.0f}x (goal >= 10x)")
    print(f"ratio training step with / without penalty: {with_p / without_p:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
