"""The DP label prior (``fedpa.dp.label_prior`` sigma > 0, sample mode): a client's Gaussian count of its labels,
released to itself once before its first DP-SGD step, and the logit correction b = log pi^ computed from it.

One record changes one count by 1 (add/remove: L2 sensitivity 1; replace-one: sqrt(2)), so c~ = c + N(0, sigma^2 I)
is one Gaussian mechanism of multiplier sigma / sensitivity, composed with the client's DP-SGD steps
(:class:`~fs_fedpa.privacy.sample_plan.SamplePlan` ``prior_sigma``). b is post-processing of c~. No FS import.
"""

from __future__ import annotations

import torch
from torch import Tensor

from fs_fedpa.privacy.mechanism import gaussian


def label_counts(labels: Tensor, classes: int) -> Tensor:
    """c: ``(K,)`` float64, the count of each label in ``labels`` (integers in [0, K)); ValueError for others."""
    labels = torch.as_tensor(labels).reshape(-1)
    if labels.numel() and (labels.is_floating_point() or int(labels.min()) < 0 or int(labels.max()) >= classes):
        raise ValueError(f"fedpa.dp.label_prior needs integer labels in [0, {classes}) (model.seqcls.num_labels)")
    return torch.bincount(labels.long(), minlength=classes).double()


def noisy_counts(labels: Tensor, classes: int, sigma: float, generator) -> Tensor:
    """c~ = c + N(0, sigma^2 I): ``(K,)`` float64, the noise from ``generator`` (the DP generator)."""
    c = label_counts(labels, classes)
    return c + gaussian((classes,), sigma, generator, c)


def prior_bias(noisy: Tensor) -> Tensor:
    """b = log pi^, pi^ = max(c~, 1) / sum max(c~, 1): ``(K,)`` float32 (post-processing of c~)."""
    kept = noisy.double().clamp(min=1.0)
    return (kept / kept.sum()).log().float()


class LabelPrior:
    """A client's prior: sigma, and b once released (:meth:`release`); :meth:`state_dict` holds b for a resume."""

    def __init__(self, sigma: float, classes: int):
        self.sigma, self.classes = float(sigma), int(classes)
        self.bias: Tensor | None = None

    def release(self, labels: Tensor, generator) -> Tensor:
        """b from a fresh count of ``labels``; only once (a second count would be a second, unaccounted release)."""
        if self.bias is not None:
            raise RuntimeError("the label prior is released once a client: a second count is not accounted")
        self.bias = prior_bias(noisy_counts(labels, self.classes, self.sigma, generator))
        return self.bias

    def state_dict(self) -> dict:
        return {} if self.bias is None else {"label_prior": self.bias.detach().cpu().clone()}

    def load_state_dict(self, saved: dict, at: str) -> None:
        """b from a resume file's ``privacy`` field ``saved`` (``at`` names it); ValueError for a b of another shape,
        or one that no count gives (non-finite or positive entries)."""
        if "label_prior" not in saved:
            raise ValueError(f"{at}: field 'privacy.label_prior' is missing (fedpa.dp.label_prior is on)")
        bias = saved["label_prior"]
        if not (isinstance(bias, Tensor) and bias.shape == (self.classes,) and bias.is_floating_point()
                and bool(torch.isfinite(bias).all()) and bool((bias <= 0).all())):  # fmt: skip
            raise ValueError(f"{at}: field 'privacy.label_prior' is not a log prior of {self.classes} labels")
        self.bias = bias.float().clone()
