"""A quantized frozen base: LLM.int8 or 4-bit NF4 weights from bitsandbytes, LoRA factors and heads in full precision.

``fedpa.base_quantization`` (``none`` | ``int8`` | ``nf4``) loads the frozen base of a model with
``from_pretrained(..., quantization_config=BitsAndBytesConfig(...))``: every ``nn.Linear`` of the base becomes a
bitsandbytes ``Linear8bitLt`` (int8 weights, a float32 scale per row; LLM.int8's forward, with outlier columns above
6 in float16) or ``Linear4bit`` (NF4 codes in blocks of 64, a float32 absmax per block, computed in float32). What
trains is not quantized: PEFT's LoRA factors wrap the quantized layer in float32, and a classifier head
(:data:`HEADS`) and the output embedding stay as the unquantized model loads them. So every method reads and writes
the same factors as on a float32 base; only the frozen W_0 they are added to is rounded. A method that writes
W_0 (merges, folds, a personal phase over the global adapter frozen in it) is refused by the plugin's check.

Why bitsandbytes (measured on this project's CPU, torch 2.13 CPU build; docs/dev/plugin.md): bitsandbytes 0.46.1 to
0.50.2 train LoRA on an int8 and an NF4 base on the CPU (CUDA is its first platform; not measured here), through
transformers' own loading path, and PEFT has LoRA layers for both of its linear types; torchao 0.18 trains on its
int8 weights, but its int4 conversion fails (``Requires mslk >= 1.0.0``); optimum-quanto 0.2.7 has int2/4/8 and
float8, no NF4.
``prepare_model_for_kbit_training`` is not applied: what it would cast to float32 loads in float32 already, and the
gradient checkpointing it turns on trades step time for activation memory whatever the base's precision.

No FederatedScope here: ``fs_fedpa.plugin.quantization_fs`` checks the key and builds FS's models with it.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence

CHOICES = ("none", "int8", "nf4")
INSTALL = "pip install 'fs_fedpa[quant]'"
# PEFT's modules_to_save for sequence classification: the head trains, so it must not be quantized
HEADS = ("classifier", "score")
_INT8_CAST = "MatMul8bitLt: inputs will be cast from"


def backend_problem(quantization: str) -> str | None:
    """Why ``quantization`` cannot load in this Python (a sentence naming the key and the fix), or None."""
    if quantization == "none":
        return None
    if quantization not in CHOICES:
        return f"fedpa.base_quantization(={quantization!r}) must be one of {CHOICES}"
    try:
        import accelerate  # noqa: F401  (transformers' bitsandbytes loader needs it)
        import bitsandbytes
    except Exception as exc:  # ImportError, or a bitsandbytes build that fails on this platform
        return (
            f"fedpa.base_quantization {quantization!r} needs bitsandbytes and accelerate, which do not import here "
            f"({type(exc).__name__}: {exc}): {INSTALL}"
        )
    import transformers
    from transformers.utils import is_bitsandbytes_available

    if not is_bitsandbytes_available():
        return (
            f"fedpa.base_quantization {quantization!r}: transformers {transformers.__version__} does not accept "
            f"bitsandbytes {bitsandbytes.__version__} on this machine (too old a bitsandbytes, or a transformers "
            f"that needs CUDA for it): pip install -U transformers 'fs_fedpa[quant]'"
        )
    return None


def load_kwargs(quantization: str, keep: Sequence[str] = ()) -> dict:
    """``from_pretrained`` keyword arguments that load the base in ``quantization``: ``{}`` for ``none``.

    ``keep``: names of modules left unquantized (a trained head); empty keeps transformers' default (the output
    embedding). The device is transformers' default for quantized loads (the current accelerator, else the CPU);
    FS then moves the model to the run's device, which bitsandbytes' parameters follow."""
    if quantization == "none":
        return {}
    import torch
    from transformers import BitsAndBytesConfig

    skip = {"llm_int8_skip_modules": list(keep)} if keep else {}
    if quantization == "int8":
        config = BitsAndBytesConfig(load_in_8bit=True, **skip)
        quiet_int8_cast_notice()
    elif quantization == "nf4":
        config = BitsAndBytesConfig(
            load_in_4bit=True, bnb_4bit_quant_type="nf4", bnb_4bit_compute_dtype=torch.float32, **skip
        )
    else:
        raise ValueError(f"fedpa.base_quantization(={quantization!r}) must be one of {CHOICES}")
    return {"quantization_config": config}


def keep_packable_4bit(model) -> list[str]:
    """Turn off bitsandbytes' CPU repacking of a 4-bit weight where it would fail; the names of those layers.

    On a CPU with AVX512-BF16, bitsandbytes (0.48 on) repacks a ``Linear4bit`` weight in place at its first forward
    in eval mode without gradients, reshaping the per-block absmax to (out, in // blocksize). A layer whose input
    width is not a multiple of the block size (64) cannot be reshaped so, and every evaluation then fails; such a
    layer keeps the layout it was loaded in (the packed one is only a faster kernel). Other layers are left to
    bitsandbytes. Hosts without AVX512-BF16 never repack."""
    kept = []
    for name, module in model.named_modules():
        if getattr(module, "support_avx512bf16_for_cpu", False):
            state = getattr(module.weight, "quant_state", None)
            blocksize = getattr(state, "blocksize", 64) or 64
            if module.in_features % blocksize:
                module.support_avx512bf16_for_cpu = False
                kept.append(name)
    return kept


def quiet_int8_cast_notice() -> None:
    """Drop bitsandbytes' "inputs will be cast from float32 to float16" notice: LLM.int8 logs it at every forward of
    every int8 layer (casting is how it quantizes activations), thousands of lines a round in FS's log."""
    log = logging.getLogger("bitsandbytes.autograd._functions")
    if not any(isinstance(f, _DropInt8Cast) for f in log.filters):
        log.addFilter(_DropInt8Cast())


class _DropInt8Cast(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_INT8_CAST)


def weight_bytes(model) -> dict[str, int]:
    """Bytes the model's parameters and buffers hold: ``quantized`` (bitsandbytes weights with their scales and
    code books) and ``full`` (everything else: LoRA factors, heads, norms, embeddings)."""
    quantized = full = 0
    seen: set[int] = set()
    for module in model.modules():
        for tensor in [*module.parameters(recurse=False), *module.buffers(recurse=False)]:
            if id(tensor) in seen:
                continue
            seen.add(id(tensor))
            extra = _quant_state_bytes(tensor)
            if extra is None:
                full += tensor.nbytes
            else:
                quantized += tensor.nbytes + extra
    return {"quantized": quantized, "full": full}


def _quant_state_bytes(tensor) -> int | None:
    """Bytes of a bitsandbytes parameter's scales beside its codes; None for a plain tensor."""
    kind = type(tensor).__name__
    if kind == "Int8Params":
        scb = getattr(tensor, "SCB", None)
        return 0 if scb is None else scb.nbytes
    if kind == "Params4bit":
        state = getattr(tensor, "quant_state", None)
        if state is None:
            return 0
        return sum(t.nbytes for t in (state.absmax, state.code) if t is not None)
    return None


def describe(model, quantization: str) -> str:
    """One log line: how many linear layers are quantized and the bytes of the weights."""
    quantized = sum(type(m).__name__ in ("Linear8bitLt", "Linear4bit") for m in model.modules())
    held = weight_bytes(model)
    mib = 2**20
    return (
        f"[fedpa] base loaded in {quantization}: {quantized} linear layers quantized, {held['quantized'] / mib:.2f} "
        f"MiB of quantized weights, {held['full'] / mib:.2f} MiB in full precision"
    )
