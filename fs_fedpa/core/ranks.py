"""Rank plans and initialisation (Algorithm 1, lines 1-5).

Each client i has a computation rank r_i (its local factors, compute and uplink) and a
reference rank R_i (the global reference it receives, downlink). The server holds global
factors of rank ``r_g = max r_i`` at initialisation and ``R_g = max R_i`` after each
reconstruction. Truncation keeps the *first* columns of B and rows of A; with B_g = Q_B U S
those are the leading singular directions.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Tensor

from fs_fedpa.core._checks import check_positive_int


@dataclass(frozen=True)
class RankPlan:
    """Per-client ranks of one federation.

    Attributes:
        client_ranks: r_i, one per client.
        reference_ranks: R_i, one per client.
        global_rank: R_g, the rank of the server's reconstruction (>= every R_i).
        adapter_rank: r, the rank of the configured adapter, whose raw-factor scale lambda is quoted in
            (:meth:`fs_fedpa.lora.ClientSpace.penalty_weight`); 0 means r_g.
    """

    client_ranks: tuple[int, ...]
    reference_ranks: tuple[int, ...]
    global_rank: int
    adapter_rank: int = 0

    def __post_init__(self) -> None:
        n = len(self.client_ranks)
        if n == 0:
            raise ValueError("client_ranks is empty: a plan needs at least one client")
        if len(self.reference_ranks) != n:
            raise ValueError(f"len(reference_ranks)(={len(self.reference_ranks)}) != number of clients(={n})")
        for i, r in enumerate(self.client_ranks):
            check_positive_int(r, f"client_ranks[{i}]")
        for i, R in enumerate(self.reference_ranks):
            check_positive_int(R, f"reference_ranks[{i}]")
        check_positive_int(self.global_rank, "global_rank")
        if self.adapter_rank != 0:
            check_positive_int(self.adapter_rank, "adapter_rank")
        for i, R in enumerate(self.reference_ranks):
            if R > self.global_rank:
                raise ValueError(
                    f"reference_ranks[{i}](={R}) > R_g(={self.global_rank}): a reference cannot exceed the global rank"
                )

    @classmethod
    def build(
        cls,
        num_clients: int,
        rank: int,
        client_ranks: Sequence[int] | None = None,
        reference_ranks: Sequence[int] | None = None,
        global_rank: int | None = None,
    ) -> RankPlan:
        """Plan for ``num_clients`` clients.

        Args:
            num_clients: N.
            rank: the adapter rank used for every r_i when ``client_ranks`` is empty.
            client_ranks: r_i per client, or empty/None for ``rank`` everywhere.
            reference_ranks: R_i per client, or empty/None for R_g everywhere.
            global_rank: R_g; default ``max R_i`` if references are given, else ``r_g``
                (the paper's homogeneous setting, R_g = r).
        """
        check_positive_int(num_clients, "num_clients")
        check_positive_int(rank, "rank")
        r = _per_client(client_ranks, num_clients, "client_ranks") or (rank,) * num_clients
        R = _per_client(reference_ranks, num_clients, "reference_ranks")
        if global_rank is None:
            global_rank = max(R) if R else max(r)
        return cls(tuple(r), tuple(R) if R else (global_rank,) * num_clients, global_rank, rank)

    @property
    def num_clients(self) -> int:
        return len(self.client_ranks)

    @property
    def r_g(self) -> int:
        """Rank of the global initialisation, ``max_i r_i`` (Alg. 1 l.1)."""
        return max(self.client_ranks)

    @property
    def R_g(self) -> int:
        return self.global_rank

    @property
    def lam_rank(self) -> int:
        """The rank whose raw-factor scale lambda is quoted in: the configured adapter rank, else r_g."""
        return self.adapter_rank or self.r_g

    def check_layer(self, d: int, k: int, name: str = "layer") -> None:
        """Raise if a rank exceeds ``min(d, k)`` of an adapted ``(d, k)`` layer."""
        limit = min(d, k)
        if self.r_g > limit:
            raise ValueError(f"{name}: client rank r_g(={self.r_g}) > min(d, k)(={limit}) of its {d}x{k} weight")
        if self.R_g > limit:
            raise ValueError(f"{name}: global rank R_g(={self.R_g}) > min(d, k)(={limit}) of its {d}x{k} weight")


def expand_groups(values: Sequence[int], num_clients: int, sizes: Sequence[int] | None = None) -> list[int]:
    """Per-client list from group values, clients assigned to groups in contiguous blocks.

    ``expand_groups([2, 4, 16], 20)`` gives the paper's three resource groups (sizes 7, 7, 6:
    the remainder goes to the first groups). With ``sizes`` the blocks are given explicitly
    and must sum to ``num_clients``. A list already of length ``num_clients`` and no sizes is
    returned unchanged.
    """
    check_positive_int(num_clients, "num_clients")
    values = list(values)
    if not values:
        raise ValueError("values is empty")
    if sizes is None:
        if len(values) > num_clients:
            raise ValueError(f"{len(values)} groups for {num_clients} clients: every group needs a client")
        base, extra = divmod(num_clients, len(values))
        sizes = [base + (g < extra) for g in range(len(values))]
    else:
        sizes = list(sizes)
        if len(sizes) != len(values):
            raise ValueError(f"len(sizes)(={len(sizes)}) != number of groups(={len(values)})")
        for g, s in enumerate(sizes):
            check_positive_int(s, f"sizes[{g}]")
        if sum(sizes) != num_clients:
            raise ValueError(f"group sizes {sizes} sum to {sum(sizes)}, not to the number of clients(={num_clients})")
    return [v for v, s in zip(values, sizes) for _ in range(s)]


def init_global_factors(
    d: int,
    k: int,
    rank: int,
    *,
    generator: torch.Generator | None = None,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str | None = None,
) -> tuple[Tensor, Tensor]:
    """Global initialisation ``(B_g^(0), A_g^(0))`` of rank r_g (Alg. 1 l.2, §4.1).

    ``B_g: (d, rank)`` is zero and ``A_g: (rank, k)`` is Kaiming-uniform with ``a = sqrt(5)``
    over fan-in k, exactly as PEFT initialises ``lora_A`` (``init_lora_weights=True``), so a
    given RNG state yields PEFT's values.
    """
    check_positive_int(d, "d")
    check_positive_int(k, "k")
    check_positive_int(rank, "rank")
    B = torch.zeros(d, rank, dtype=dtype, device=device)
    A = torch.empty(rank, k, dtype=dtype, device=device)
    torch.nn.init.kaiming_uniform_(A, a=math.sqrt(5), generator=generator)
    return B, A


def fresh_factors(like: dict[str, tuple[Tensor, Tensor]], rank: int) -> dict[str, tuple[Tensor, Tensor]]:
    """PEFT's initialisation (:func:`init_global_factors`) at ``rank`` for every module of ``like``
    (``B: (d, *)``, ``A: (*, k)``), in its dtype and on its device, drawn from the worker's random stream."""
    return {
        n: init_global_factors(B.shape[0], A.shape[1], rank, dtype=A.dtype, device=A.device)
        for n, (B, A) in like.items()
    }


def truncate_factors(B: Tensor, A: Tensor, rank: int) -> tuple[Tensor, Tensor]:
    """First ``rank`` columns of ``B: (*, d, R)`` and rows of ``A: (*, R, k)`` (Alg. 1 l.4 and l.8).

    Returns fresh tensors (never views of the inputs); if ``rank > R`` the missing columns
    and rows are zero, so a rank-R_i reference of a lower-rank global is well defined.
    """
    check_positive_int(rank, "rank")
    if B.shape[-1] != A.shape[-2]:
        raise ValueError(f"B has {B.shape[-1]} columns but A has {A.shape[-2]} rows")
    have = B.shape[-1]
    if rank <= have:
        return B[..., :rank].clone(), A[..., :rank, :].clone()
    pad = rank - have
    return (
        torch.cat([B, B.new_zeros((*B.shape[:-1], pad))], dim=-1),
        torch.cat([A, A.new_zeros((*A.shape[:-2], pad, A.shape[-1]))], dim=-2),
    )


def _per_client(values: Sequence[int] | None, n: int, name: str) -> tuple[int, ...]:
    if values is None or len(values) == 0:
        return ()
    if isinstance(values, (str, bytes)):
        raise ValueError(f"{name} must be a list of ints, got {values!r}")
    if len(values) != n:
        raise ValueError(f"len({name})(={len(values)}) != number of clients(={n})")
    return tuple(check_positive_int(v, f"{name}[{i}]") for i, v in enumerate(values))
