"""FedSA-LoRA [Guo et al., 2025]: A is shared and averaged, B stays with each client (it carries the
client-specific knowledge). Paper: arxiv.org/abs/2410.01463"""

from __future__ import annotations

from fs_fedpa.methods.fedit import FedIT


class FedSALoRA(FedIT):
    name = "fedsa_lora"
    keeps = (True, False)  # (B, A): a client's own B, the global A
