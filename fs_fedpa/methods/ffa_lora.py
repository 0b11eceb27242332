"""FFA-LoRA [Sun et al., 2024]: A stays frozen at its shared random initialisation; only B is trained, sent and
averaged, which makes factor-wise averaging exact. Paper: arxiv.org/abs/2403.12313

The server completes each upload with the global A it holds, so the averaged A is that frozen A bit for bit.
"""

from __future__ import annotations

from fs_fedpa.methods.fedit import FedIT


class FFALoRA(FedIT):
    name = "ffa_lora"
    uses = frozenset({"trainable"})
    dp_space = "change"

    def trainable(self, rnd: int) -> tuple[bool, bool]:
        return True, False

    def upload_parts(self, rnd: int) -> tuple[str, ...]:
        return ("B",)
