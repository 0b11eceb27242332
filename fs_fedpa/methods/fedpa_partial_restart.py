"""FedPA-LoRA with a partial restart: between local preservation (``fedpa``, mu = 0) and the full restart
(``fedpa_no_preservation``, mu = 1). At each round's start client i trains from

    B_i <- (1 - mu) B_i + mu B_r,    A_i <- (1 - mu) A_i + mu A_r,

with (B_r, A_r) the rank-r_i truncation of the received reference (zero-padded where R_i < r_i, so its shapes are
those of (B_i, A_i)). The server and the alignment term are FedPA's. Under DP it is post-processing: it reads only
the client's own (DP-trained) factors and the server's released reference.
"""

from __future__ import annotations

from dataclasses import dataclass

from fs_fedpa.config_sections import key
from fs_fedpa.methods.base import Factors, FederatedMethod
from fs_fedpa.methods.fedpa import FedPA
from fs_fedpa.values import number


@dataclass
class PartialRestartOptions:
    """``fedpa.fedpa_partial_restart``."""

    mu: float = key(
        0.5,
        "In (0, 1]: a round starts from (1 - mu) own factors + mu the reference truncated to r_i (1: "
        "fedpa_no_preservation)",
    )

    def __post_init__(self) -> None:
        self.mu = number(self.mu, "fedpa_partial_restart.mu", minimum=0.0)
        if not 0.0 < self.mu <= 1.0:
            raise ValueError(f"fedpa.fedpa_partial_restart.mu(={self.mu}) must be in (0, 1]")


class FedPAPartialRestart(FedPA):
    name = "fedpa_partial_restart"
    uses = frozenset({"alignment"})
    dp_space = "product"
    options = PartialRestartOptions

    def start_round(self, received: Factors, own: Factors, client: int, rnd: int) -> Factors:
        mu = self.opts.mu
        restart = FederatedMethod.start_round(self, received, own, client, rnd)
        out = {}
        for name, (B, A) in own.items():
            B_r, A_r = restart[name]
            if B_r.shape != B.shape or A_r.shape != A.shape:
                raise ValueError(f"fedpa_partial_restart: module {name!r} keeps factors {tuple(B.shape)}, "
                                 f"{tuple(A.shape)} but its reference truncates to {tuple(B_r.shape)}, "
                                 f"{tuple(A_r.shape)}")  # fmt: skip
            out[name] = ((1 - mu) * B + mu * B_r, (1 - mu) * A + mu * A_r)
        return out
