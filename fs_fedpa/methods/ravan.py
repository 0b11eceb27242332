"""Ravan [Raje et al. 2025, "Ravan: Multi-Head Low-Rank Adaptation for Federated Fine-Tuning"]: every adapted
weight gets ``Delta W = sum_h s_h B_h H_h A_h`` over H heads, with random bases ``B_h`` (d x r_h) and ``A_h``
(r_h x k) drawn once and frozen, and trainable cores ``H_h`` (r_h x r_h) and scales ``s_h``. Each round every
client starts from the global cores with ``s_h = 1``, trains the cores and scales of K_i of the heads (chosen at
random; the others stay frozen in the forward pass) and uploads ``s_h H_h`` of those alone; the server takes each
head's unweighted mean over the clients that trained it (exact: the mean of their ``s_h B_h H_h A_h``), keeps a
head nobody trained, and sends every client all H cores. Paper: arxiv.org/abs/2506.05568 (Alg. 1, Eq. 8).

Choices where the paper is silent (docs/dev/baselines.md lists them): the bases are Gaussian with variance 1/d (B) and
1/k (A), so that their columns/rows have the unit norm of the paper's Gram-Schmidt variant, drawn per module from a
seed every worker shares (nothing about them travels); the heads a client trains are one uniform draw per client
and round for every layer (the paper's "random" rule), from a stream the server derives too; a client's budget is
K_i = r_i / min r_i heads (the FedPA-LoRA paper's h_i in {1, 2, 8} for r_i in {2, 4, 16}) and r_h the largest rank
with K_i r_h^2 <= r_i (d + k), i.e. no more trainable parameters than its rank-r_i LoRA; there is no alpha / r.

The pairs this method keeps per module are ``(cores: (H, r_h, r_h), scales: (H,))``, not LoRA factors;
:meth:`Ravan.expand` turns them into the factors ``([B_1 s_1 H_1 .. B_H s_H H_H], [A_1; ..; A_H])`` of the update.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Sequence
from dataclasses import dataclass

import torch
from torch import Generator, Tensor

from fs_fedpa import lora
from fs_fedpa.config_sections import key
from fs_fedpa.core._checks import normalized_weights
from fs_fedpa.methods.base import Factors, FederatedMethod, Uploads, complete_selected, seeded_subset, trainer_shares
from fs_fedpa.values import int_list, integer


@dataclass
class RavanOptions:
    """``fedpa.ravan``."""

    heads: list[int] = key(
        [],
        "Ravan: K_i, the heads client i trains each round (per client, or per group with fedpa.group_sizes); the "
        "adapter has H = max K_i heads; empty: K_i = r_i / min r_i (the paper's r_i 2, 4, 16 -> 1, 2, 8)",
        was="ravan_heads",
    )
    head_rank: int = key(
        0,
        "Ravan: r_h, the rank of every head; 0: per module the largest r_h with K_i r_h^2 <= r_i (d + k) for every "
        "client (the parameter budget of its rank-r_i LoRA)",
        was="ravan_head_rank",
    )

    def __post_init__(self) -> None:
        self.heads = int_list(self.heads, "ravan.heads")
        self.head_rank = integer(self.head_rank, "ravan.head_rank", minimum=0)


class Ravan(FederatedMethod):
    name = "ravan"
    options = RavanOptions
    uses = frozenset({"before_upload"})
    full_references = "of its heads"
    state_is_factors = False

    def __init__(self, cfg, plan, seed=None):
        super().__init__(cfg, plan, seed)
        n = len(plan.client_ranks)
        r_min = min(plan.client_ranks)
        default = [max(1, round(r / r_min)) for r in plan.client_ranks]
        self.heads = cfg.per_client("ravan.heads", n, self.opts.heads) or default  # K_i
        self.H = max(self.heads)
        self.ranks: dict[str, int] = {}  # r_h per module, set by bind()
        self._bases: dict[str, tuple[Tensor, Tensor]] = {}

    def bind(self, shapes: dict[str, tuple[int, int]]) -> None:
        super().bind(shapes)
        self.ranks = {name: self._head_rank(name, d, k) for name, (d, k) in shapes.items()}

    def _head_rank(self, name: str, d: int, k: int) -> int:
        if self.opts.head_rank:
            return self.opts.head_rank
        budget = min(r * (d + k) // K for r, K in zip(self.plan.client_ranks, self.heads))
        r_h = math.isqrt(budget)
        if r_h < 1:
            raise ValueError(f"{name}: no head rank r_h >= 1 has K_i r_h^2 <= r_i (d + k); set fedpa.ravan.head_rank")
        return r_h

    def bases(self, name: str) -> tuple[Tensor, Tensor]:
        """``(B: (d, H r_h), A: (H r_h, k))``, float32 on the CPU: the frozen bases of module ``name``, the same on
        every worker (drawn from the run's seed and the module's name)."""
        if name not in self._bases:
            (d, k), r = self.shapes[name], self.ranks[name]
            key = hashlib.blake2b(f"ravan:{self.seed}:{name}".encode(), digest_size=8).digest()
            stream = torch.Generator().manual_seed(int.from_bytes(key, "little") >> 1)
            B = torch.randn(d, self.H * r, generator=stream) / math.sqrt(d)
            A = torch.randn(self.H * r, k, generator=stream) / math.sqrt(k)
            self._bases[name] = (B, A)
        return self._bases[name]

    def selection(self, client: int, rnd: int) -> list[int]:
        """The K_i heads client ``client`` trains in round ``rnd`` (sorted indices; the same in every layer)."""
        return seeded_subset("ravan", self.seed, rnd, client, self.H, self.heads[client])

    def expand(self, state: Factors) -> Factors:
        """``(B, A)`` with ``B = [B_1 s_1 H_1, ..., B_H s_H H_H]`` (d, H r_h) and ``A = [A_1; ..; A_H]``."""
        out = {}
        for name, (cores, scales) in state.items():
            B, A = (t.to(cores) for t in self.bases(name))
            d, (H, r, _) = B.shape[0], cores.shape
            scaled = cores * scales[:, None, None]
            out[name] = (torch.einsum("dhr,hrq->dhq", B.view(d, H, r), scaled).reshape(d, H * r), A)
        return out

    # ------------------------------------------------------------------ server
    def init_global(self, shapes: dict[str, tuple[int, int]], generator: torch.Generator) -> Factors:
        """Every core 0 (so Delta W = 0) and every scale 1."""
        return {name: (torch.zeros(self.H, self.ranks[name], self.ranks[name]), torch.ones(self.H)) for name in shapes}

    def weights(self, round_samples: Sequence[float], data_sizes: Sequence[float | None]) -> list[float]:
        return [1.0] * len(round_samples)  # the paper's 1 / |C_h|

    def downlink(self, global_: Factors, client: int) -> Factors:
        return global_  # all H cores (and their H scales, 1)

    def upload_ranks(self, client: int) -> tuple[int, ...]:
        return tuple(sorted({self.H * r for r in self.ranks.values()}))  # of the expanded factors

    def upload_parts(self, rnd: int) -> tuple[str, ...]:
        return ("B",)  # s_h H_h of the trained heads; the scales restart at 1

    def upload_payload(self, sent: Factors, client: int, rnd: int) -> dict[str, dict[str, Tensor]]:
        chosen = self.selection(client, rnd)
        return {name: {"B": cores[chosen]} for name, (cores, _) in sent.items()}

    def complete_upload(
        self, upload: dict[str, dict[str, Tensor]], global_: Factors, client: int, rnd: int = 0
    ) -> Factors:
        """The H global cores with the client's ``s_h H_h`` in place of the K_i it trained; scales 1."""
        chosen = self.selection(client, rnd)

        def place(name: str, parts: dict[str, Tensor], pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
            sent, (cores, scales) = parts["B"], pair
            if tuple(sent.shape) != (len(chosen), *cores.shape[1:]):
                raise ValueError(
                    f"module {name!r}: uploaded cores {tuple(sent.shape)}; client #{client + 1} trains the heads "
                    f"{chosen} in round {rnd}, so they are ({len(chosen)}, {cores.shape[1]}, {cores.shape[2]})"
                )
            full = cores.clone()
            full[chosen] = sent.to(full)
            return full, torch.ones_like(scales)

        return complete_selected(upload, global_, place)

    def aggregate(
        self, uploads: Uploads, weights: Sequence[float], clients: Sequence[int], generator: Generator, rnd: int = 0
    ) -> tuple[Factors, dict[str, Tensor]]:
        """Head h: ``H_h = mean_{c in C_h} s_ch H_ch`` over the clients C_h that trained it (Eq. 8); a head nobody
        trained keeps the global core every completed upload holds."""
        w = normalized_weights(weights, len(uploads))
        share = trainer_shares([self.selection(c, rnd) for c in clients], w, self.H)
        out = {}
        for name, (cores0, scales0) in uploads[0].items():
            c = share.to(cores0)  # (N, H)
            out[name] = (
                sum(c[i][:, None, None] * u[name][0] for i, u in enumerate(uploads)),
                torch.ones_like(scales0),
            )
        return out, {}

    # ------------------------------------------------------------------ client
    def client_init(self, global_init: Factors, client: int) -> Factors:
        return {n: (H.clone(), s.clone()) for n, (H, s) in global_init.items()}

    def start_round(self, received: Factors, own: Factors, client: int, rnd: int) -> Factors:
        """The received cores, every scale 1: Ravan keeps nothing of its own across rounds."""
        return {n: (H.clone(), torch.ones_like(s)) for n, (H, s) in received.items()}

    def load(self, model, state: Factors, trainable: bool | tuple[bool, bool], client: int, rnd: int) -> None:
        """The frozen bases as PEFT's factors and the cores and scales as the layers' heads; the K_i heads of
        :meth:`selection` trainable when ``trainable`` is."""
        heads = self.selection(client, rnd) if any(trainable if isinstance(trainable, tuple) else (trainable,)) else ()
        lora.set_heads(model, {n: self.bases(n) for n in state}, state, heads)

    def read(self, model) -> Factors:
        return lora.get_heads(model)

    def before_upload(self, local: Factors, received: Factors, rnd: int) -> Factors:
        """``(s_h H_h, 1)`` per head: the update as the server will hold it."""
        return {n: (H * s[:, None, None], torch.ones_like(s)) for n, (H, s) in local.items()}
