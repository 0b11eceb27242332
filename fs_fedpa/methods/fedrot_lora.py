"""FedRot-LoRA: before factor-wise averaging, each client rotates its factors (B R, R^T A) by the orthogonal
Procrustes rotation that best aligns them with the global factors it received; the product is unchanged.
The aligned factor alternates by round parity (A in even rounds, B in odd ones); the rotation is proper
(det R = +1, as the paper's §3.1 states), and ``fedpa.rotation_strength`` λ softens it to the rotation nearest
(1 - λ) I + λ R, FedRot-LoRA's alignment strength (1.0, the default, is the hard rotation)."""

from __future__ import annotations

from fs_fedpa.core.align import rotate_to
from fs_fedpa.methods.base import Factors
from fs_fedpa.methods.fedit import FedIT


class FedRotLoRA(FedIT):
    name = "fedrot_lora"

    def before_upload(self, local: Factors, received: Factors, rnd: int) -> Factors:
        which = "A" if rnd % 2 == 0 else "B"
        strength = self.cfg.rotation_strength
        return {n: rotate_to(B, A, *received[n], which, strength)[:2] for n, (B, A) in local.items()}
