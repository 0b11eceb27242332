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
from _common import _sync, fmt, median_time

from fs_fedpa import product_penalty


def penalty_case(d: int, r: int, repeats: int, device: str = "cpu") -> tuple[float, float]:
    g = torch.Generator().manual_seed(d)
    B = (torch.randn(d, r, generator=g) * 0.01).to(device).requires_grad_()
    A = (torch.randn(r, d, generator=g) / d**0.5).to(device).requires_grad_()
    B_ref = (torch.randn(d, r, generator=g) * 0.01).to(device)
    A_ref = (torch.randn(r, d, generator=g) / d**0.5).to(device)

    def factored():
        product_penalty(B, A, B_ref, A_ref).backward()

    def dense():
        (B @ A - B_ref @ A_ref).pow(2).sum().backward()

    return median_time(factored, repeats), median_time(dense, repeats)


def training_step_ratio(
    steps: int, batch: int, seq: int, device: str = "cpu", hidden: int = 1024, layers: int = 4
) -> tuple[float, float]:
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM

    from fs_fedpa import lora
    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.core.ranks import RankPlan
    from fs_fedpa.methods.fedpa import FedPA

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=8000,
        hidden_size=hidden,
        intermediate_size=hidden * 11 // 4,
        num_hidden_layers=layers,
        num_attention_heads=max(1, hidden // 64),
        num_key_value_heads=max(1, hidden // 64),
        max_position_embeddings=seq,
    )
    model = peft.get_peft_model(
        LlamaForCausalLM(config), peft.LoraConfig(r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"])
    ).to(device)
    live = lora.get_factors(model)
    reference = {n: (torch.randn_like(B) * 0.01, torch.randn_like(A) * 0.03) for n, (B, A) in live.items()}
    method = FedPA(FedPAConfig(lam=1.0), RankPlan.build(1, 8))
    optimizer = torch.optim.AdamW([p for p in model.parameters() if p.requires_grad], lr=1e-4)
    tokens = torch.randint(0, 8000, (batch, seq)).to(device)

    def step(with_penalty: bool) -> float:
        _sync()
        start = time.perf_counter()
        loss = model(input_ids=tokens, labels=tokens).loss
        if with_penalty:
            loss = loss + method.alignment(live, reference, 1.0)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        _sync()
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
    parser.add_argument("--device", default="cpu", help="cpu or cuda (a GPU host)")
    parser.add_argument("--tiny", action="store_true", help="small shapes: checks that it runs, not the goals")
    args = parser.parse_args()
    dev = args.device
    print(f"\n(a) penalty forward+backward, float32, {dev}, {torch.get_num_threads()} threads")
    ratios = {}
    hidden, layers = (128, 2) if args.tiny else (1024, 4)
    for d, r in ((128, 4), (256, 8)) if args.tiny else ((1024, 4), (4096, 8)):
        t_fact, t_dense = penalty_case(d, r, args.repeats, dev)
        ratios[(d, r)] = t_dense / t_fact
        print(f"  d=k={d}, r=R={r}: factored {fmt(t_fact)}   dense product {fmt(t_dense)}")
    shape = f"Llama hidden {hidden} x {layers} layers, LoRA r=8 on q,v, batch {args.batch} x {args.seq}"
    print(f"\n(b) training step, {shape}, {dev}")
    with_p, without_p = training_step_ratio(args.steps, args.batch, args.seq, dev, hidden, layers)
    print(f"  with penalty {fmt(with_p)}   without {fmt(without_p)}")
    print()
    for (d, r), ratio in ratios.items():
        print(f"speedup dense-product penalty / factored penalty @ d={d},r={r}: {ratio:.0f}x (goal >= 10x)")
    print(f"ratio training step with / without penalty: {with_p / without_p:.3f} (goal <= 1.05)")


if __name__ == "__main__":
    main()
