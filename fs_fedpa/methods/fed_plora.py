"""Fed-PLoRA [Zhang, Hu and Xu, ICLR 2026, "Heterogeneous Federated Fine-Tuning with Parallel One-Rank
Adaptation"]: the global adapter of rank R is R parallel rank-one modules ``Delta W = sum_j b_j a_j``. Each round,
client i draws r_i of them at random (Select-N-Fold), adds the product of the other R - r_i to its frozen base
weights (so it starts exactly from the global model), trains the r_i drawn modules from their global values and
uploads them alone; the server averages each module's b_j and a_j over the clients that trained it (unweighted,
the paper's 1/|Q_j|), keeps a module nobody trained, and sends every client all R modules.
Paper: arxiv.org/abs/2602.16936; authors' code (TNI-playground/Fed-PLoRA) could not be read here.

Choices where the paper is silent (docs/dev/baselines.md lists them): one draw per client and round for every layer,
from a stream seeded by (seed, round, client) so that the server knows it without it being sent; the global rank
R is ``r_g = max r_i``; the modules start as PEFT's LoRA (b = 0, a Kaiming-uniform); a client trains at PEFT's
scale of its rank r_i (the fold and the upload are applied updates, so the scale changes no product).
"""

from __future__ import annotations

from collections.abc import Sequence

from torch import Generator, Tensor

from fs_fedpa.core._checks import normalized_weights
from fs_fedpa.methods.base import Factors, FederatedMethod, Uploads, complete_selected, seeded_subset
from fs_fedpa.methods.base import trainer_shares


class FedPLoRA(FederatedMethod):
    name = "fed_plora"
    uses = frozenset({"fold"})
    full_references = "R = max r_i modules"

    def weights(self, round_samples: Sequence[float], data_sizes: Sequence[float | None]) -> list[float]:
        return [1.0] * len(round_samples)

    def selection(self, client: int, rnd: int) -> list[int]:
        """The r_i modules client ``client`` trains in round ``rnd`` (sorted indices into the R global ones)."""
        return seeded_subset("fed_plora", self.seed, rnd, client, self.plan.r_g, self.plan.client_ranks[client])

    def _unselected(self, client: int, rnd: int) -> list[int]:
        chosen = set(self.selection(client, rnd))
        return [j for j in range(self.plan.r_g) if j not in chosen]

    # ------------------------------------------------------------------ server
    def upload_ranks(self, client: int) -> tuple[int, ...]:
        return (self.plan.r_g,)  # as completed: the client's r_i modules in place among the global ones

    def complete_upload(
        self, upload: dict[str, dict[str, Tensor]], global_: Factors, client: int, rnd: int = 0
    ) -> Factors:
        """The R global modules with the client's trained ones put in place of those it drew."""
        chosen = self.selection(client, rnd)

        def place(name: str, parts: dict[str, Tensor], pair: tuple[Tensor, Tensor]) -> tuple[Tensor, Tensor]:
            (B, A), (B_g, A_g) = (parts["B"], parts["A"]), pair
            if B.shape != (B_g.shape[0], len(chosen)) or A.shape != (len(chosen), A_g.shape[1]):
                raise ValueError(
                    f"module {name!r}: uploaded B {tuple(B.shape)}, A {tuple(A.shape)}; client #{client + 1} trains "
                    f"the {len(chosen)} modules {chosen} in round {rnd}, so B is ({B_g.shape[0]}, {len(chosen)}) "
                    f"and A ({len(chosen)}, {A_g.shape[1]})"
                )
            B_full, A_full = B_g.clone(), A_g.clone()
            B_full[:, chosen] = B.to(B_full)
            A_full[chosen] = A.to(A_full)
            return B_full, A_full

        return complete_selected(upload, global_, place)

    def aggregate(
        self, uploads: Uploads, weights: Sequence[float], clients: Sequence[int], generator: Generator, rnd: int = 0
    ) -> tuple[Factors, dict[str, Tensor]]:
        """Module j: ``sum_{i in Q_j} w_i (b_ij, a_ij) / sum_{i in Q_j} w_i`` over the clients Q_j that trained it;
        a module nobody trained is the global one every completed upload holds."""
        w = normalized_weights(weights, len(uploads))
        share = trainer_shares([self.selection(c, rnd) for c in clients], w, self.plan.r_g)
        out = {}
        for name, (B0, _) in uploads[0].items():
            c = share.to(B0)  # (N, R): client i's share of module j
            B = sum(c[i] * u[name][0] for i, u in enumerate(uploads))  # column j scaled by c[i, j]
            A = sum(c[i][:, None] * u[name][1] for i, u in enumerate(uploads))
            out[name] = (B, A)
        return out, {}

    # ------------------------------------------------------------------ client
    def start_round(self, received: Factors, own: Factors, client: int, rnd: int) -> Factors:
        chosen = self.selection(client, rnd)
        return {n: (B[:, chosen].clone(), A[chosen].clone()) for n, (B, A) in received.items()}

    def fold(self, received: Factors, client: int, rnd: int) -> Factors | None:
        rest = self._unselected(client, rnd)
        if not rest:
            return None
        return {n: (B[:, rest], A[rest]) for n, (B, A) in received.items()}
