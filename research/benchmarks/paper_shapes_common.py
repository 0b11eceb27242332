"""The settings and small helpers bench_paper_shapes.py and its client step share: the paper's shapes (SHAPES,
MODELS, PAPER), their tiny stand-ins, the random factors of an adapter, the old penalty path and the aten-call count
of a step."""

from __future__ import annotations

import os
import sys
import time

import torch
from torch import nn


LAM = 1.0  # the paper's optimal lambda for FedPA-LoRA on SST-2 (Table tab:hyperparameters)
COEF = LAM / 2

SHAPES = {
    "roberta-large": {
        "layers": 24, "targets": {"query": (1024, 1024), "value": (1024, 1024)},  # (d = out, k = in)
        "r": 4, "R_i": 4, "N": 10, "R_g": 4, "local_steps": 20,
    },
    "llama-3-8b": {
        "layers": 32, "targets": {"q_proj": (4096, 4096), "v_proj": (1024, 4096)},
        "r": 8, "R_i": 8, "N": 6, "R_g": 8, "local_steps": 30,
    },
}  # fmt: skip
MODELS = {  # the models' widths (depth and vocabulary: settings())
    "roberta-large": {"hidden": 1024, "heads": 16, "kv_heads": 16, "intermediate": 4096},
    "llama-3-8b": {"hidden": 4096, "heads": 32, "kv_heads": 8, "intermediate": 14336},
}
# --tiny: the same two layouts at toy widths, so that the script itself runs in seconds (gpu_check --tiny, the tests)
TINY_SHAPES = {
    "roberta-large": {**SHAPES["roberta-large"], "layers": 2, "targets": {"query": (64, 64), "value": (64, 64)},
                      "r": 4, "R_i": 4, "N": 3, "R_g": 4},
    "llama-3-8b": {**SHAPES["llama-3-8b"], "layers": 2, "targets": {"q_proj": (64, 64), "v_proj": (32, 64)},
                   "r": 4, "R_i": 4, "N": 3, "R_g": 4},
}  # fmt: skip
TINY_MODELS = {
    "roberta-large": {"hidden": 64, "heads": 4, "kv_heads": 4, "intermediate": 128},
    "llama-3-8b": {"hidden": 64, "heads": 4, "kv_heads": 2, "intermediate": 128},
}

# The paper's numbers, seconds. Client: Table tab:client_wallclock (per client and round, first round excluded);
# "full" is the Full LoRA Update row (FedIT, FlexLoRA), "fedpa" the Product-Regularized LoRA Update row.
# Server: Table tab:server_wallclock (per round, homogeneous ranks); randomized with p = 8 (l = R_g + 8), the
# oversampling reconstruct's randomized mode uses by default.
PAPER = {
    "roberta-large": {
        "client": {"single": 9.1388, "full": 9.2053, "fedrot": 9.2121, "feddpa": 10.3431, "fedpa": 9.4603},
        "server": {"averaging": 0.0298, "single_averaging": 0.0206, "dense": 4.7340, "reduced": 0.0840,
                   "randomized_p0": 0.0473, "randomized": 0.0493, "randomized_p16": 0.0529, "randomized_p32": 0.0615},
    },
    "llama-3-8b": {
        "client": {"single": 3.8015, "full": 3.8324, "fedrot": 3.9323, "feddpa": 3.8371, "fedpa": 5.1343},
        "server": {"averaging": 0.0199, "single_averaging": 0.0109, "dense": 152.3957, "reduced": 0.1169,
                   "randomized_p0": 0.0596, "randomized": 0.0638, "randomized_p16": 0.0706, "randomized_p32": 0.0901},
    },
}  # fmt: skip

T0 = time.perf_counter()


def say(msg: str) -> None:
    print(f"[{time.perf_counter() - T0:7.1f} s] {msg}", flush=True)


def module_names(spec: dict, layers: int | None = None) -> dict[str, tuple[int, int]]:
    """``name -> (d, k)`` of the adapter's modules, layer by layer (the first ``layers`` layers, default all)."""
    n = spec["layers"] if layers is None else layers
    return {f"layers.{i}.{t}": dk for i in range(n) for t, dk in spec["targets"].items()}


def make_factors(spec: dict, device: str, seed: int = 0):
    """Live factors (parameters, B mid-training size) and a rank-R_i reference for every module of the adapter."""
    g = torch.Generator().manual_seed(seed)
    r, R = spec["r"], spec["R_i"]
    live, reference = {}, {}
    for name, (d, k) in module_names(spec).items():
        live[name] = (nn.Parameter((torch.randn(d, r, generator=g) * 0.01).to(device)),
                      nn.Parameter((torch.randn(r, k, generator=g) / k**0.5).to(device)))  # fmt: skip
        reference[name] = ((torch.randn(d, R, generator=g) * 0.01).to(device),
                           (torch.randn(R, k, generator=g) / k**0.5).to(device))  # fmt: skip
    return live, reference


def old_term(live, reference) -> torch.Tensor:
    """The old path: lam/2 * sum over modules of product_penalty, through autograd."""
    from fs_fedpa.core.penalty import product_penalty

    return 0.5 * LAM * torch.stack([product_penalty(B, A, *reference[n]) for n, (B, A) in live.items()]).sum()


def aten_calls(fn) -> int:
    """aten operator calls (every event, nested included) of one call of ``fn``. Kineto writes a line to the
    process's stderr at each start and stop of the profiler: stderr goes to /dev/null meanwhile."""
    from torch.profiler import ProfilerActivity, profile

    sys.stderr.flush()
    saved, null = os.dup(2), os.open(os.devnull, os.O_WRONLY)
    os.dup2(null, 2)
    try:
        with profile(activities=[ProfilerActivity.CPU]) as prof:
            fn()
    finally:
        os.dup2(saved, 2)
        os.close(saved), os.close(null)
    return sum(1 for e in prof.events() if e.name.startswith("aten::"))


def factor_steps(live, reference, term):
    params = [p for pair in live.values() for p in pair]

    def zero():
        for p in params:
            p.grad = None

    def stub():
        return sum(B.sum() + A.sum() for B, A in live.values())

    return {
        "stub": lambda: (zero(), stub().backward()),
        "stub+new": lambda: (zero(), (stub() + term(COEF)).backward()),
        "stub+old": lambda: (zero(), (stub() + old_term(live, reference)).backward()),
        "new": lambda: (zero(), term(COEF).backward()),
        "old": lambda: (zero(), old_term(live, reference).backward()),
    }


def ratio(a, b) -> str:
    return "      --" if a is None or b is None or b == 0 else f"{a / b:7.2f}x"


def ms(x) -> str:
    return "        --" if x is None else f"{x:10.1f}" if abs(x) >= 100 else f"{x:10.3f}"
