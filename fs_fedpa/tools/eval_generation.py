"""Evaluate a FedPA checkpoint's global adapter on GSM8K (exact match) or HumanEval (pass@1).

    python -m fs_fedpa.tools.eval_generation gsm8k --base <model dir or hub name> --ckpt <federate.save_to file> \\
        --data gsm8k/test.jsonl --shots-from gsm8k/train.jsonl [--limit N] [--device cuda:0] [--out results.json]
    python -m fs_fedpa.tools.eval_generation humaneval --base ... --ckpt ... --data HumanEval.jsonl.gz

The checkpoint's ``fedpa.global`` holds the effective global factors ``(B_g, A_g)`` of every LoRA module
(PEFT's scaling folded in), so the adapted weight is exactly ``W_0 + B_g A_g``; it is merged into the
base model's weights. Generation is greedy. HumanEval runs model-written code: see
``fs_fedpa.tasks.humaneval``.
"""

from __future__ import annotations

import json
import sys
import time
import zipfile
from pathlib import Path

from fs_fedpa.tools import cli

WRAPPER_PREFIXES = ("model.base_model.model.", "base_model.model.", "model.")


def read_global(ckpt_path: str) -> dict:
    """The global factors ``{module: (B_g, A_g)}`` of a FedPA checkpoint, read as tensors only (a checkpoint cannot
    run code); a ValueError naming the file when it is not one."""
    import pickle

    import torch

    if not zipfile.is_zipfile(ckpt_path):  # torch.save's format; anything else reaches torch's unpickler
        raise ValueError(f"{ckpt_path} is not a checkpoint (torch.save's zip archive); pass federate.save_to of a run")
    try:
        ckpt = torch.load(ckpt_path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError) as exc:
        reason = (str(exc).strip().splitlines() or [""])[0][:200]
        raise ValueError(f"{ckpt_path}: not a checkpoint of tensors ({type(exc).__name__}: {reason})") from None
    if not isinstance(ckpt, dict) or "fedpa" not in ckpt:
        raise ValueError(
            f"{ckpt_path} is not a FedPA checkpoint (no 'fedpa' entry); pass federate.save_to of a fedpa run"
        )
    return ckpt["fedpa"]["global"]


def merge_global_adapter(model, ckpt) -> int:
    """Add ``B_g A_g`` to the weight of every module named in the checkpoint; returns how many were merged.
    ``ckpt``: the checkpoint's path, or the factors :func:`read_global` read from it."""
    import torch

    factors = read_global(ckpt) if isinstance(ckpt, (str, Path)) else ckpt
    modules = dict(model.named_modules())
    merged = 0
    with torch.no_grad():
        for name, (B, A) in factors.items():
            target = _resolve(name, modules)
            weight = target.weight
            if weight.shape != (B.shape[0], A.shape[1]):
                raise ValueError(
                    f"{name}: adapter {B.shape[0]}x{A.shape[1]} does not fit weight {tuple(weight.shape)}"
                )
            weight += (B.double() @ A.double()).to(weight.dtype).to(weight.device)
            merged += 1
    return merged


def _resolve(name: str, modules: dict):
    """Map an FS ``AdapterModel``/PEFT module name onto the plain HF model's module."""
    for candidate in (name, *(name[len(p) :] for p in WRAPPER_PREFIXES if name.startswith(p))):
        if candidate in modules:
            return modules[candidate]
    raise ValueError(f"module {name!r} of the checkpoint is not in the base model")


def generate(model, tokenizer, prompt: str, max_new_tokens: int, device: str) -> str:
    import torch

    inputs = tokenizer(prompt, return_tensors="pt").to(device)
    with torch.no_grad():
        out = model.generate(
            **inputs,
            max_new_tokens=max_new_tokens,
            do_sample=False,
            pad_token_id=tokenizer.pad_token_id or tokenizer.eos_token_id,
        )
    return tokenizer.decode(out[0, inputs["input_ids"].shape[1] :], skip_special_tokens=True)


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="python -m fs_fedpa.tools.eval_generation", description=__doc__.splitlines()[0])
    parser.add_argument("task", choices=["gsm8k", "humaneval"])
    parser.add_argument("--base", required=True, help="base causal LM: local directory or hub name")
    parser.add_argument("--ckpt", help="FedPA checkpoint (federate.save_to of the run)")
    parser.add_argument("--no-adapter", action="store_true", help="evaluate the base model alone")
    parser.add_argument("--data", required=True, help="GSM8K test.jsonl or HumanEval.jsonl.gz")
    parser.add_argument("--shots-from", help="GSM8K train.jsonl for the few-shot prompt (0-shot without)")
    parser.add_argument("--shots", type=cli.number(int, minimum=0), default=8)
    parser.add_argument("--limit", type=cli.number(int, minimum=1), help="the first LIMIT problems only")
    parser.add_argument("--max-new-tokens", type=cli.number(int, minimum=1), default=256)
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--out", default="generation_results.json")
    args = parser.parse_args(argv)
    if not args.no_adapter and not args.ckpt:
        parser.error("--ckpt is required unless --no-adapter")
    files = {"--data": args.data, "--shots-from": args.shots_from, "--ckpt": None if args.no_adapter else args.ckpt}
    for flag, path in files.items():  # all before the base model, whose load takes minutes for a real LM
        if path is not None and not Path(path).is_file():
            parser.error(f"{flag} {path}: no such file")
    factors = None
    if not args.no_adapter:
        try:
            factors = read_global(args.ckpt)
        except ValueError as exc:
            parser.error(str(exc))

    if args.task == "gsm8k":
        from fs_fedpa.tasks.gsm8k import exact_match, few_shot_prompt, load_gsm8k

        shots = _read(parser, "--shots-from", args.shots_from, load_gsm8k) if args.shots_from else []
        records = _read(parser, "--data", args.data, lambda path: load_gsm8k(path, args.limit))
    else:
        from fs_fedpa.tasks.humaneval import completion_from_generation, load_humaneval, pass_at_1

        problems = _read(parser, "--data", args.data, load_humaneval)[: args.limit]

    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(args.base)
    model = AutoModelForCausalLM.from_pretrained(args.base).to(args.device).eval()
    if factors is not None:
        print(f"merged the global adapter into {merge_global_adapter(model, factors)} modules", flush=True)

    items, start = [], time.time()
    if args.task == "gsm8k":
        for i, rec in enumerate(records, start=1):
            text = generate(
                model, tokenizer, few_shot_prompt(rec["question"], shots, args.shots), args.max_new_tokens, args.device
            )
            text = text.split("\n\nQuestion:")[0]  # the model may go on with a new shot
            items.append(
                {
                    "question": rec["question"],
                    "reference": rec["reference"],
                    "output": text,
                    "correct": exact_match(text, rec["reference"]),
                }
            )
            _progress(i, len(records), start)
        metric = {"exact_match": sum(it["correct"] for it in items) / len(items)}
    else:
        for i, problem in enumerate(problems, start=1):
            text = generate(model, tokenizer, problem["prompt"], args.max_new_tokens, args.device)
            items.append({"task_id": problem["task_id"], "completion": completion_from_generation(text)})
            _progress(i, len(problems), start)
        metric = {"pass@1": pass_at_1(items, problems)}
    Path(args.out).write_text(json.dumps({"task": args.task, **metric, "items": items}, indent=1))
    print(f"{args.task}: {metric} over {len(items)} items; details in {args.out}")
    return 0


def _read(parser, flag: str, path: str, load):
    """``load(path)``, or one line naming the flag when the file is not the task's JSON lines (before the model)."""
    try:
        return load(path)
    except (ValueError, KeyError, TypeError, OSError, EOFError) as exc:
        parser.error(f"{flag} {path}: not this task's JSON lines ({type(exc).__name__}: {str(exc)[:120]})")


def _progress(i: int, n: int, start: float) -> None:
    if i == n or i % max(1, n // 20) == 0:
        print(f"  {i}/{n} ({time.time() - start:.0f} s)", flush=True)


if __name__ == "__main__":
    sys.exit(cli.one_line_errors(main, "eval_generation")())
