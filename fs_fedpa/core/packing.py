"""Sequence packing: a right-padded batch's records laid out whole in a few rows of at most ``budget`` positions.
No FS import.

n records padded to L, of lengths l_i, go longest first into the first row with room (first-fit decreasing); a row
has W = max(budget, max_i l_i) positions. Each record keeps its tokens in order at an offset of its row, and attends
only to itself (a block-diagonal mask), so an encoder whose positions interact only through attention gives each
record the hidden states of the padded batch, to float summation order, while its dense layers run on about Σ l_i
positions rather than n·L. (A padded position attends to its row's other padded positions, so no mask row is empty.)
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor


def first_fit(lengths: list[int], budget: int) -> list[list[int]]:
    """Record indices in rows, first-fit decreasing: each record, longest first (ties in index order), goes into the
    first row whose total length stays within max(budget, longest)."""
    width = max([budget, *lengths])
    rows: list[list[int]] = []
    room: list[int] = []
    for i in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        for r, left in enumerate(room):
            if lengths[i] <= left:
                rows[r].append(i)
                room[r] -= lengths[i]
                break
        else:
            rows.append([i])
            room.append(width - lengths[i])
    return rows


def right_padded(mask: Tensor) -> bool:
    """Whether every row of a ``(n, L)`` 0/1 attention mask is ones then zeros."""
    lengths = mask.sum(1, keepdim=True)
    return bool((mask.bool() == (torch.arange(mask.shape[1], device=mask.device) < lengths)).all())


@dataclass
class Packing:
    """Where the attended tokens of a ``(n, L)`` right-padded batch go in ``(R, W)`` packed rows.

    ``src`` (T,): flat index of each attended token in the padded batch (record-major); ``dst`` (T,): its flat index
    in the packed rows; ``segment`` (R, W): the record at each packed position, -1 at padding; ``offset`` (R, W): its
    position within its record, 0 at padding."""

    src: Tensor
    dst: Tensor
    segment: Tensor
    offset: Tensor
    padded: tuple[int, int]

    @classmethod
    def of(cls, mask: Tensor, budget: int) -> Packing:
        """The packing of right-padded ``mask`` (n, L) into rows of ``budget`` positions (see :func:`first_fit`)."""
        n, L = mask.shape
        lengths = mask.sum(1).tolist()
        rows = first_fit(lengths, budget)
        width = max([budget, *lengths]) if n else 0
        start, row = [0] * n, [0] * n
        for r, members in enumerate(rows):
            at = 0
            for i in members:
                start[i], row[i], at = at, r, at + lengths[i]
        device = mask.device
        record = torch.repeat_interleave(torch.arange(n, device=device), mask.sum(1))  # (T,)
        offset = torch.cat([torch.arange(int(k), device=device) for k in lengths]) if n else record
        base = torch.tensor(row, device=device) * width + torch.tensor(start, device=device)
        dst = base[record] + offset
        segment = torch.full((len(rows) * width,), -1, dtype=torch.long, device=device)
        segment[dst] = record
        packed_offset = torch.zeros_like(segment)
        packed_offset[dst] = offset
        shape = (len(rows), width)
        return cls(record * L + offset, dst, segment.view(shape), packed_offset.view(shape), (n, L))

    @property
    def rows(self) -> int:
        return self.segment.shape[0]

    def pack(self, x: Tensor, fill=0) -> Tensor:
        """``(n, L, ...) -> (R, W, ...)``: the attended tokens in their packed places, ``fill`` elsewhere."""
        flat = x.reshape(-1, *x.shape[2:])
        out = flat.new_full((self.segment.numel(), *x.shape[2:]), fill)
        out[self.dst] = flat[self.src]
        return out.view(*self.segment.shape, *x.shape[2:])

    def unpack(self, y: Tensor) -> Tensor:
        """``(R, W, ...) -> (n, L, ...)``: each record's tokens back in its padded row, zeros at its padding."""
        n, L = self.padded
        flat = y.reshape(-1, *y.shape[2:])
        out = flat.new_zeros((n * L, *y.shape[2:])).index_copy(0, self.src, flat[self.dst])
        return out.view(n, L, *y.shape[2:])

    def attention(self) -> Tensor:
        """``(R, 1, W, W)`` bool: query and key belong to the same record (or are both padding of the row)."""
        return (self.segment[:, :, None] == self.segment[:, None, :])[:, None]
