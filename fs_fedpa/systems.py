"""What a piece of work cost: its wall seconds and the peak memory of the device it ran on, measured by the code
that does the work (no log parsing). No FederatedScope here.

Peak memory is CUDA's allocator peak (``torch.cuda.max_memory_allocated``, reset at the start of the span) where
the work runs on a CUDA device, else the process's peak resident set size over the span (Linux: ``VmHWM``, reset by
writing 5 to ``/proc/self/clear_refs``; elsewhere the process's lifetime peak, ``ru_maxrss``). Both cost a few
microseconds, so measuring is always on.
"""

from __future__ import annotations

import sys
import time

import torch

# a client's systems statistics in its upload (fs_fedpa.plugin.client_round); the round record keeps them per client
# without the prefix (fs_fedpa.record.RoundRecord). DP policies keep them on the client (they depend on the draws).
SYSTEMS_STATS = ("sys_train_seconds", "sys_train_batches", "sys_train_examples", "sys_train_tokens",
                 "sys_peak_memory")  # fmt: skip


def memory_kind(device: torch.device | str | None) -> str:
    """``"cuda"`` where ``device`` is a CUDA device, else ``"rss"``."""
    return "cuda" if device is not None and torch.device(device).type == "cuda" else "rss"


def reset_peak(device: torch.device | str | None) -> None:
    """Start a new peak: CUDA's allocator peak of ``device``, or the process's peak RSS where the OS lets it reset."""
    if memory_kind(device) == "cuda":
        torch.cuda.reset_peak_memory_stats(device)
        return
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
    except OSError:  # not Linux, or not allowed: the peak stays the process's lifetime one
        pass


def peak_bytes(device: torch.device | str | None) -> int:
    """The peak since :func:`reset_peak` (CUDA: allocated bytes of ``device``; else the process's resident bytes)."""
    if memory_kind(device) == "cuda":
        return int(torch.cuda.max_memory_allocated(device))
    try:
        with open("/proc/self/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    import resource

    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return int(peak if sys.platform == "darwin" else peak * 1024)  # macOS reports bytes, Linux KiB


class Span:
    """One measured piece of work on ``device``: ``with Span(device) as span: ...``, then :attr:`seconds` and
    :attr:`peak` (bytes, of :attr:`kind`)."""

    def __init__(self, device: torch.device | str | None = None):
        self.device, self.kind = device, memory_kind(device)
        self.seconds, self.peak = 0.0, 0
        self._start = 0.0

    def __enter__(self) -> Span:
        reset_peak(self.device)
        self._start = time.perf_counter()
        return self

    def __exit__(self, *exc) -> None:
        if self.kind == "cuda":
            torch.cuda.synchronize(self.device)  # the work queued on the device is part of the span
        self.seconds = time.perf_counter() - self._start
        self.peak = peak_bytes(self.device)


class TrainCounter:
    """Batches, examples and tokens of a client's training, counted per batch without a device sync: the token count
    stays a tensor on the batch's device until :meth:`take`. Tokens: the attention mask's ones where the batch has
    one, else the input ids' count (None for a batch of neither)."""

    def __init__(self):
        self.batches, self.examples, self._tokens = 0, 0, None

    def count(self, batch, batch_size: int | None) -> None:
        self.batches += 1
        self.examples += int(batch_size or 0)
        tokens = None
        if isinstance(batch, dict):
            if isinstance(mask := batch.get("attention_mask"), torch.Tensor):
                tokens = mask.sum()
            elif isinstance(ids := batch.get("input_ids"), torch.Tensor):
                tokens = torch.tensor(ids.numel())
        if tokens is not None:
            self._tokens = tokens if self._tokens is None else self._tokens + tokens.to(self._tokens.device)

    def take(self) -> dict[str, int]:
        """The counts since the last :meth:`take` (``tokens`` only where some batch had them), then zero."""
        out = {"batches": self.batches, "examples": self.examples}
        if self._tokens is not None:
            out["tokens"] = int(self._tokens)
        self.batches, self.examples, self._tokens = 0, 0, None
        return out


def round_stats(span: Span, counts: dict[str, int]) -> dict[str, float]:
    """A client's training round as upload statistics (:data:`SYSTEMS_STATS`)."""
    stats = {"sys_train_seconds": span.seconds, "sys_train_batches": counts["batches"],
             "sys_train_examples": counts["examples"], "sys_peak_memory": span.peak}  # fmt: skip
    if "tokens" in counts:
        stats["sys_train_tokens"] = counts["tokens"]
    return stats

