"""FlexLoRA [Bai et al., 2024]: the server takes the truncated SVD of the averaged products; clients restart
from the global factors at their own rank every round. Paper: arxiv.org/abs/2402.11505

Same server as FedPA-LoRA (the SVD optimum, computed without the dense matrix unless ``fedpa.svd: dense``,
which is FlexLoRA's own route), without local factor preservation and without alignment: the
factor-level initialisation mismatch E_init of §3.2 is what remains.
"""

from __future__ import annotations

from torch import Tensor

from fs_fedpa.methods.base import Factors, FederatedMethod
from fs_fedpa.methods.fedpa import FedPA


class FlexLoRA(FedPA):
    name = "flexlora"

    def weights(self, round_samples, data_sizes) -> list[float]:
        """FlexLoRA weighs each client's update by its local data size (its Eq. for the global update): the
        ``num_train_data`` a client reports, which the server bounds like the sample size (an integer in [0, 1e15];
        beyond it the upload is dropped, so no client can make the global its own update)."""
        if any(n is None for n in data_sizes):
            return list(round_samples)
        return [float(n) for n in data_sizes]

    def start_round(self, received: Factors, own: Factors, client: int, rnd: int) -> Factors:
        return FederatedMethod.start_round(self, received, own, client, rnd)

    def alignment(self, local: Factors, reference: Factors, lam: float) -> Tensor | None:
        return None

    def product_alignment(self) -> bool:
        return False
