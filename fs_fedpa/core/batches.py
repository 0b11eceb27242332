"""Splitting a training batch into records and length-sorted chunks. No FS import: a batch is a tensor, or a dict,
list or tuple of them (FS's ``ctx.data_batch``), whose tensors with first dimension ``size`` are split by record.

On a CPU a padded forward computes over its longest record, so the records of a batch forwarded in chunks of similar
length cost their own lengths rather than the batch's longest (DP-SGD's per-example chunks, the plain step's
``model.seqcls.train_chunk``)."""

from __future__ import annotations

import torch
from torch import Tensor


def attended(batch, size: int) -> Tensor | None:
    """``(size,)`` the attended positions of each record (its attention mask's sum), or None without a mask."""
    if isinstance(batch, dict):
        mask = batch.get("attention_mask")
        if isinstance(mask, Tensor) and mask.ndim == 2 and mask.shape[0] == size:
            return mask.sum(1).cpu()
        batch = list(batch.values())
    if isinstance(batch, (list, tuple)):
        for v in batch:
            if (found := attended(v, size)) is not None:
                return found
    return None


def length_chunks(batch, size: int, chunk: int) -> list[Tensor]:
    """The batch's record indices in chunks of at most ``chunk``, sorted by length (attended positions; stable) where
    the batch has an attention mask, else in order."""
    lengths = attended(batch, size)
    order = torch.argsort(lengths, stable=True) if lengths is not None else torch.arange(size)
    return list(order.split(max(1, chunk)))


def select_records(batch, index: Tensor, size: int):
    """Records ``index`` of a batch (every tensor whose first dimension is the batch's), as a batch."""
    if isinstance(batch, Tensor):
        return batch[index.to(batch.device)] if batch.ndim and batch.shape[0] == size else batch
    if isinstance(batch, dict):
        return {k: select_records(v, index, size) for k, v in batch.items()}
    if isinstance(batch, (list, tuple)):
        return type(batch)(select_records(v, index, size) for v in batch)
    return batch
