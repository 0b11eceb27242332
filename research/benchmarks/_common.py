"""Shared helpers of the benchmark scripts: timing and realistic client factors."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import torch


def median_time(fn: Callable[[], object], repeats: int = 5, warmup: int = 1) -> float:
    """Median wall time in seconds of ``fn()`` over ``repeats`` calls, after ``warmup`` untimed calls; on a GPU the
    queued kernels are waited for before each clock read."""
    return interleaved_times({"fn": fn}, repeats, warmup)["fn"]


def interleaved_times(fns: dict[str, Callable[[], object]], repeats: int = 5, warmup: int = 1) -> dict[str, float]:
    """Median wall time in seconds of each ``fns[name]()``, the calls taken round-robin (one of each per round) so
    that a slow spell of the machine hits every variant alike and the ratios between them stay meaningful."""
    for _ in range(warmup):
        for fn in fns.values():
            fn()
    times: dict[str, list[float]] = {name: [] for name in fns}
    for _ in range(repeats):
        for name, fn in fns.items():
            _sync()
            start = time.perf_counter()
            fn()
            _sync()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(ts) for name, ts in times.items()}


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def client_factors(n: int, d: int, k: int, r: int, seed: int = 0, dtype=torch.float32):
    """N clients' LoRA factors with a shared component, as after federated training on related data.

    ``B_i = B_shared + 0.3 * noise``, ``A_i = A_shared + 0.3 * noise`` with ``A`` at PEFT's init scale:
    the aggregate then has a decaying spectrum (a dominant rank-r part plus client-specific tails),
    unlike products of independent Gaussians whose spectrum is flat.
    """
    g = torch.Generator().manual_seed(seed)
    B0 = torch.randn(d, r, generator=g) * 0.01
    A0 = torch.randn(r, k, generator=g) / k**0.5
    Bs = [(B0 + 0.3 * torch.randn(d, r, generator=g) * 0.01).to(dtype) for _ in range(n)]
    As = [(A0 + 0.3 * torch.randn(r, k, generator=g) / k**0.5).to(dtype) for _ in range(n)]
    return Bs, As


def fmt(seconds: float) -> str:
    return f"{seconds * 1e3:10.3f} ms"


def fs_runner(cfg_file: str):
    """Stock FS's standalone runner for the yaml ``cfg_file``, built in this process as ``federatedscope.main``
    builds it (logger, seed, data, workers), so a benchmark can patch the plugin's classes before ``runner.run()``."""
    from federatedscope.core.auxiliaries.data_builder import get_data
    from federatedscope.core.auxiliaries.logging import update_logger
    from federatedscope.core.auxiliaries.runner_builder import get_runner
    from federatedscope.core.auxiliaries.utils import setup_seed
    from federatedscope.core.auxiliaries.worker_builder import get_client_cls, get_server_cls
    from federatedscope.core.configs.config import global_cfg

    cfg = global_cfg.clone()
    cfg.merge_from_file(cfg_file)
    update_logger(cfg, clear_before_add=True)
    setup_seed(cfg.seed)
    fs_data, modified = get_data(config=cfg.clone(), client_cfgs=None)
    cfg.merge_from_other_cfg(modified)
    cfg.freeze(inform=False)  # the config goes to the run's config.yaml, not ~470 lines of the benchmark's output
    return get_runner(data=fs_data, server_class=get_server_cls(cfg), client_class=get_client_cls(cfg),
                      config=cfg.clone(), client_configs=None)  # fmt: skip

