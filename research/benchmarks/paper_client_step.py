"""Item 2 of bench_paper_shapes.py: one client's training step at a paper shape (plain, with the alignment term
new and old, DP-SGD), on a model built with the paper's widths."""

from __future__ import annotations

import gc

import torch
import torch.nn.functional as F
from _common import interleaved_times
from paper_shapes_common import COEF, old_term


def build_model(shape: str, spec: dict, device: str, layers: int, vocab: int, seq: int, width: dict):
    import peft
    from transformers import LlamaConfig, LlamaForCausalLM, RobertaConfig, RobertaForSequenceClassification

    if shape == "roberta-large":
        config = RobertaConfig(vocab_size=vocab, hidden_size=width["hidden"], num_hidden_layers=layers,
                               num_attention_heads=width["heads"], intermediate_size=width["intermediate"],
                               max_position_embeddings=514, type_vocab_size=1, layer_norm_eps=1e-5, pad_token_id=1,
                               bos_token_id=0, eos_token_id=2, num_labels=2)  # fmt: skip
        with torch.device(device):
            model = RobertaForSequenceClassification(config)
    else:
        config = LlamaConfig(vocab_size=vocab, hidden_size=width["hidden"], intermediate_size=width["intermediate"],
                             num_hidden_layers=layers, num_attention_heads=width["heads"],
                             num_key_value_heads=width["kv_heads"], max_position_embeddings=max(seq, 8192),
                             rope_theta=500000.0, rms_norm_eps=1e-5, tie_word_embeddings=False)  # fmt: skip
        with torch.device(device):
            model = LlamaForCausalLM(config)
    lora_cfg = peft.LoraConfig(r=spec["r"], lora_alpha=2 * spec["r"], lora_dropout=0.0,
                               target_modules=list(spec["targets"]))  # fmt: skip
    return peft.get_peft_model(model.float(), lora_cfg).to(device)


def client_step(shape: str, spec: dict, device: str, layers: int, vocab: int, batch: int, seq: int,
                repeats: int, width: dict) -> dict:  # fmt: skip
    """Item 2: plain, with the term (new, old), DP-SGD steps of one client, round-robin."""
    from fs_fedpa import lora
    from fs_fedpa.core.batched_penalty import ProductTerm
    from fs_fedpa.privacy.mechanism import dp_generator, gaussian_flat

    try:  # the project's pure-torch DP-SGD pieces (no FederatedScope); a missing piece skips the DP-SGD step only
        from fs_fedpa.privacy.per_example import (
            LinearTaps,
            clipped_sum_flat,
            describe_gaps,
            linear_owners,
            per_example_matrix,
            sum_gaps,
            sum_mismatch,
        )

        skipped = ""
    except ImportError as err:
        skipped = f"DP-SGD step skipped: {err}"

    torch.manual_seed(0)
    model = build_model(shape, spec, device, layers, vocab, seq, width)
    model.train()
    live = lora.get_factors(model)
    with torch.no_grad():  # B mid-training, not PEFT's zeros (a zero B gives A no gradient)
        for B, _ in live.values():
            B.normal_(0, 0.01)
    R = spec["R_i"]
    reference = {n: (torch.randn(B.shape[0], R, device=device) * 0.01,
                     torch.randn(R, A.shape[1], device=device) / A.shape[1] ** 0.5)
                 for n, (B, A) in live.items()}  # fmt: skip
    params = [p for p in model.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=1e-5)
    term = ProductTerm(live, reference)
    ids = torch.randint(3, vocab, (batch, seq), device=device)
    labels = torch.randint(0, 2, (batch,), device=device)

    def losses() -> torch.Tensor:
        """(batch,): each record's task loss."""
        if shape == "roberta-large":
            logits = model(input_ids=ids).logits
            return F.cross_entropy(logits.float(), labels, reduction="none")
        logits = model(input_ids=ids).logits
        tok = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), ids[:, 1:].flatten(), reduction="none")
        return tok.view(batch, -1).mean(1)

    def plain():
        optimizer.zero_grad()
        losses().mean().backward()
        optimizer.step()

    def with_term():
        optimizer.zero_grad()
        (losses().mean() + term(COEF)).backward()
        optimizer.step()

    def with_term_old():
        optimizer.zero_grad()
        (losses().mean() + old_term(live, reference)).backward()
        optimizer.step()

    owners, why = linear_owners(model, params) if not skipped else (None, skipped)
    if owners is None and not skipped:
        skipped = f"DP-SGD step skipped: the taps refused the model: {why}"
    C, z = 1.0, 1.0
    generator = dp_generator(0, "bench_paper_shapes")  # seeded MT19937 (fedpa.dp.seed), not the OS's secure one
    dp_state = {"check": ""}

    sizes = [p.numel() for p in params]

    def dp():
        """DP-SGD as the plugin's batched path (fs_fedpa.plugin.dp_sgd) takes it for one chunk: taps on the LoRA
        linears, one backward of the sum of the records' losses, the per-example gradients as one matrix, the check
        against autograd's gradient and the clip on the device, the chunk's one host read, the step's noise
        N(0, (z C)^2) drawn on the host in one buffer, (sum + noise) / b, AdamW step."""
        optimizer.zero_grad()
        with LinearTaps([m for m, _ in owners]) as taps:
            part = losses()
        grads = torch.autograd.grad(part.sum(), params + taps.outputs(), allow_unused=True)
        found = per_example_matrix(taps, owners, grads[len(params) :], batch)
        gaps = sum_gaps(found, grads[: len(params)], sizes)
        flat, scales = clipped_sum_flat(found, C)
        mismatch, _ = torch.stack([sum_mismatch(gaps, 1e-3), (scales == 0).sum()]).tolist()
        dp_state["check"] = describe_gaps(gaps, 1e-3) if mismatch else ""
        with torch.no_grad():
            step = flat.add_(gaussian_flat(sizes, z * C, generator, flat)).div_(batch)
            for p, g in zip(params, step.split(sizes)):
                p.grad = g.view(p.shape).to(p.dtype)
        optimizer.step()

    fns = {"plain": plain, "term": with_term, "term_old": with_term_old, **({} if skipped else {"dp": dp})}
    t = interleaved_times(fns, repeats, warmup=1)
    term.release()
    out = {
        "model_modules": len(live),
        "step_ms": t["plain"] * 1e3,
        "step_term_ms": t["term"] * 1e3,
        "step_term_old_ms": t["term_old"] * 1e3,
        "step_dp_ms": t["dp"] * 1e3 if "dp" in t else None,
        "term_ms": (t["term"] - t["plain"]) * 1e3,
        "term_old_ms": (t["term_old"] - t["plain"]) * 1e3,
        "dp_check": skipped or dp_state["check"] or "per-example gradients sum to autograd's gradient",
        "layers": layers,
        "vocab": vocab,
        "batch": batch,
        "seq": seq,
        "repeats": repeats,
    }
    del model, optimizer, live, reference, params, owners, term
    gc.collect()
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    return out
