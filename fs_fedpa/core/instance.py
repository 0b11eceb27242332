"""FedDPA's instance-wise weight of the global adapter (Yang et al., NeurIPS 2024), in plain torch."""

from __future__ import annotations

import torch
from torch import Tensor


def instance_weights(emb: Tensor, refs: Tensor, scale: float = 0.5) -> Tensor:
    """``g_b = scale * mean_j cos(emb_b, refs_bj)``: the weight of the global adapter for input b, from its
    representation ``emb`` (n, h) and those of m of the client's training inputs ``refs`` (n, m, h), both taken
    under the personal adapter alone; the personal adapter gets ``1 - g_b``. Returns (n,) in float32 at least."""
    if emb.ndim != 2 or refs.ndim != 3 or refs.shape[0] != emb.shape[0] or refs.shape[2] != emb.shape[1]:
        raise ValueError(f"need emb (n, h) and refs (n, m, h); got {tuple(emb.shape)} and {tuple(refs.shape)}")
    dtype = torch.promote_types(emb.dtype, torch.float32)
    cos = torch.nn.functional.cosine_similarity(emb.to(dtype)[:, None, :], refs.to(dtype), dim=-1)
    return scale * cos.mean(dim=1)


def representation(model: torch.nn.Module, gate, inputs: dict[str, Tensor], classifier: bool) -> Tensor:
    """(batch, hidden): the last layer's state of ``model`` under the personal adapter alone (``gate.g`` 0 for the
    pass, :class:`fs_fedpa.lora.RowGate`): [CLS] for a classifier, the last attended token otherwise (either padding
    side)."""
    previous, gate.g = gate.g, torch.zeros(inputs["input_ids"].shape[0])
    try:
        with torch.no_grad():
            hidden = model(**inputs, output_hidden_states=True).hidden_states[-1]
    finally:
        gate.g = previous
    if classifier:
        return hidden[:, 0]
    mask = inputs.get("attention_mask")
    mask = torch.ones_like(inputs["input_ids"]) if mask is None else mask
    last = (mask * torch.arange(1, mask.shape[1] + 1, device=mask.device)).argmax(dim=1)
    return hidden[torch.arange(hidden.shape[0], device=hidden.device), last]
