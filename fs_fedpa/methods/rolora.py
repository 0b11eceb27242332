"""RoLoRA [Chen et al., 2025]: clients train one factor per round, alternating, so the average of the trained
factor times the shared other one is exact. Paper: arxiv.org/abs/2409.02346

B is trained in even rounds and A in odd ones: with PEFT's B = 0 initialisation, A receives no gradient
until B moves, so starting with A would waste round 0. Only the trained factor is sent; the server completes
each upload with the other, global factor, which every client shared unchanged and which therefore stays
bit for bit.
"""

from __future__ import annotations

from fs_fedpa.methods.fedit import FedIT


class RoLoRA(FedIT):
    name = "rolora"
    uses = frozenset({"trainable"})

    def trainable(self, rnd: int) -> tuple[bool, bool]:
        return rnd % 2 == 0, rnd % 2 == 1

    def upload_parts(self, rnd: int) -> tuple[str, ...]:
        return ("B",) if rnd % 2 == 0 else ("A",)
