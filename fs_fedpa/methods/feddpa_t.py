"""FedDPA-T [Yang et al., NeurIPS 2024, "Dual-Personalizing Adapter for Federated Foundation Models"]: a global
adapter averaged factor-wise as in FedIT, and a personal adapter that never leaves the client and continues its own
trajectory from round to round. Authors' code: Lydia-yang/FedDPA.

As the authors' client (``--local_model True``): from round 1 on, each round starts with a personal phase that
trains the personal adapter under the forward ``a * personal + (1 - a) * global`` (a = 0.5, the global adapter
frozen), then a global phase that trains the received global adapter alone and uploads it; round 0 has the global
phase only. The personal adapter starts from PEFT's initialisation (B = 0). Both phases take the config's local
steps, so a round costs twice FedIT's local compute.

Test time (paper protocol): FedDPA's instance-wise weighting. Per input x, the global adapter gets
``g(x) = 0.5 * mean_j cos(h(x), h(x_j))`` and the personal one ``1 - g(x)``, with h the last layer's representation
under the personal adapter alone ([CLS] for a classifier, the last attended token for a causal LM) and x_j five of
the client's training inputs drawn afresh for each x (the authors' ``--auto True`` with ``half``, 5 instances,
``emb_type last``). The client applies it (``instance_mix``; :class:`fs_fedpa.lora.RowGate`).
"""

from __future__ import annotations

import torch

from fs_fedpa.core.ranks import fresh_factors
from fs_fedpa.methods.base import Factors
from fs_fedpa.methods.fedit import FedIT


class FedDPAT(FedIT):
    name = "feddpa_t"
    uses = frozenset({"personal_start"})
    personal_weight = 0.5
    instance_mix = 0.5

    def personal_start(self, received: Factors, personal: Factors | None, client: int, rnd: int) -> Factors | None:
        if rnd == 0:
            return None
        return personal if personal is not None else fresh_factors(received, self.plan.client_ranks[client])

    def evaluation_factors(self, received: Factors, own: Factors, client: int, personal=None) -> Factors:
        """``([B_g, B_l], [A_g; A_l])`` of rank R_i + r_i, which the client weighs per input by ``g`` and ``1 - g``
        (the global reference alone before the first personal phase)."""
        if personal is None:
            return received
        out = {}
        for name, (B_g, A_g) in received.items():
            B_l, A_l = personal[name]
            out[name] = (torch.cat([B_g, B_l.to(B_g)], dim=1), torch.cat([A_g, A_l.to(A_g)], dim=0))
        return out
