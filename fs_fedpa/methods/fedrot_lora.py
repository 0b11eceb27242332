"""FedRot-LoRA [Zhang et al., 2026]: before factor-wise averaging, each client rotates its factors (B R, R^T A) by the
orthogonal Procrustes rotation that best aligns one of them with the global factor it received; the product is
unchanged. Paper: arxiv.org/abs/2602.23638; authors' code: haoran-zh/FedRot-LoRA.

As the authors' client: no rotation in round 0 (there is no aggregate to align to yet), then A is aligned in odd
rounds and B in even ones (``initialshare: 'A'``). The rotation is proper (det R = +1), and
``fedpa.fedrot_lora.strength`` λ softens it to the rotation nearest (1 - λ) I + λ R, FedRot-LoRA's alignment
strength (0: FedIT, 1: the full rotation); the paper's per-task values are in
yaml_configs/baselines/fedrot_lora_*.yaml.
"""

from __future__ import annotations

from dataclasses import dataclass

from fs_fedpa.config_sections import key
from fs_fedpa.core.align import rotate_to
from fs_fedpa.methods.base import Factors
from fs_fedpa.methods.fedit import FedIT
from fs_fedpa.values import number


def aligned_factor(rnd: int) -> str | None:
    """The factor FedRot-LoRA aligns in round ``rnd`` (FS rounds count from 0): none, then A, B, A, ..."""
    if rnd == 0:
        return None
    return "A" if rnd % 2 == 1 else "B"


@dataclass
class FedRotOptions:
    """``fedpa.fedrot_lora``."""

    strength: float = key(
        1.0,
        "FedRot-LoRA's alignment strength in [0, 1]: the rotation nearest (1 - strength) I + strength R (1: hard "
        "Procrustes rotation)",
        was="rotation_strength",
    )

    def __post_init__(self) -> None:
        self.strength = number(self.strength, "fedrot_lora.strength", minimum=0.0)
        if self.strength > 1.0:
            raise ValueError(f"fedpa.fedrot_lora.strength(={self.strength}) must be in [0, 1]")


class FedRotLoRA(FedIT):
    name = "fedrot_lora"
    uses = frozenset({"before_upload"})
    options = FedRotOptions

    def before_upload(self, local: Factors, received: Factors, rnd: int) -> Factors:
        which = aligned_factor(rnd)
        if which is None:
            return local
        strength = self.opts.strength
        return {n: rotate_to(B, A, *received[n], which, strength)[:2] for n, (B, A) in local.items()}
