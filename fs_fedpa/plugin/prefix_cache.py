"""``model.seqcls.prefix_cache``: when LoRA adapts only the top layers of a BERT-style encoder
(``model.seqcls.layers_to_transform``), the embeddings and the layers below the first adapted one are frozen, so
their output for a record is the same at every step of every round. It is computed once per distinct record, with
that frozen prefix in eval mode (no dropout), kept on the host, and fed to the first adapted layer afterwards; the
prefix's own forward then does no work. No FS import: it wraps an HF model.

Exactness: a record's cached state is computed from its attended tokens alone (records of one length together, no
padding); inside a padded batch the same positions get the same values up to the float reordering of a longer masked
reduction (padded keys weigh exactly 0), and padded positions, which every later layer masks and the classifier's
first-token pooling never reads, are 0. tests/integration/test_dp_sgd_fs.py checks a DP-SGD step with the cache
against one without (prefix in eval mode too).

Memory: one float32 (L_i, H) tensor per distinct record on the host: n x mean length x hidden x 4 bytes (SST-2's
67k sentences at 25 tokens through MiniLM's 384: about 2.6 GB in all, across clients).
"""

from __future__ import annotations

import logging
import types

import torch
from torch import Tensor, nn

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


def encoder_of(model: nn.Module) -> nn.Module | None:
    """The BERT-style encoder inside ``model`` (a module with ``embeddings`` and ``encoder.layer``), or None."""
    for module in model.modules():
        layers = getattr(getattr(module, "encoder", None), "layer", None)
        if hasattr(module, "embeddings") and isinstance(layers, nn.ModuleList):
            return module
    return None


class PrefixCache:
    """Installed on ``model``'s encoder: its embeddings return the cached input of layer ``first`` (the lowest with a
    trainable tensor) and layers below ``first`` pass it through. ``hits`` and ``misses`` count records."""

    def __init__(self, model: nn.Module):
        encoder = encoder_of(model)
        if encoder is None:
            raise ValueError("model.seqcls.prefix_cache needs a BERT-style encoder (embeddings and encoder.layer)")
        layers = encoder.encoder.layer
        trainable = [i for i, layer in enumerate(layers) if any(p.requires_grad for p in layer.parameters())]
        if any(p.requires_grad for p in encoder.embeddings.parameters()) or not trainable or trainable[0] == 0:
            raise ValueError(
                "model.seqcls.prefix_cache needs a frozen prefix: trainable tensors only above the first layer "
                "(set model.seqcls.layers_to_transform to the top layers)"
            )
        self.first = trainable[0]
        self.prefix = [encoder.embeddings, *layers[: self.first]]
        self.pad = getattr(encoder.config, "pad_token_id", 0) or 0
        self.states: dict[bytes, Tensor] = {}
        self.hits = self.misses = 0
        self._embed = encoder.embeddings.forward  # the bound originals, called to fill the cache
        self._layers = [layer.forward for layer in layers[: self.first]]
        encoder.embeddings.forward = types.MethodType(_cached_embeddings(self), encoder.embeddings)
        for layer in layers[: self.first]:
            layer.forward = types.MethodType(_pass_through, layer)
        logger.info(f"[fedpa] prefix cache: embeddings and layers 0-{self.first - 1} computed once per record")

    def lookup(self, input_ids: Tensor, token_type_ids: Tensor | None) -> Tensor:
        """(B, L, H): the input of layer ``first`` for each row of a right-padded batch, on ``input_ids``' device."""
        rows = input_ids.shape[0]
        types_ = token_type_ids if token_type_ids is not None else torch.zeros_like(input_ids)
        ids, tts = input_ids.cpu(), types_.cpu()
        keys, lengths = [], []
        for r in range(rows):
            length = _attended(ids[r], self.pad)
            lengths.append(length)
            keys.append(ids[r, :length].numpy().tobytes() + b"|" + tts[r, :length].numpy().tobytes())
        missing = [r for r in range(rows) if keys[r] not in self.states]
        self.misses += len({keys[r] for r in missing})
        self.hits += rows - len(missing)
        by_length: dict[int, dict[bytes, int]] = {}  # length -> key -> one row with it (a batch may repeat a record)
        for r in missing:
            by_length.setdefault(lengths[r], {})[keys[r]] = r
        for length, rows_of in by_length.items():
            unique = list(rows_of.values())
            states = self._compute(input_ids[unique, :length], types_[unique, :length])
            for r, state in zip(unique, states):
                self.states[keys[r]] = state.detach().to("cpu", torch.float32)
        hidden = self.states[keys[0]].shape[-1]
        out = torch.zeros(rows, input_ids.shape[1], hidden, dtype=torch.float32)
        for r in range(rows):
            out[r, : lengths[r]] = self.states[keys[r]]
        return out.to(input_ids.device)

    def _compute(self, input_ids: Tensor, token_type_ids: Tensor) -> Tensor:
        """The prefix's output for rows of one length (no padding, so no mask), in eval mode, without gradients."""
        modes = [m.training for m in self.prefix]
        try:
            for m in self.prefix:
                m.eval()
            with torch.no_grad():
                h = self._embed(input_ids=input_ids, token_type_ids=token_type_ids)
                for forward in self._layers:
                    h = forward(h, None)
        finally:
            for m, mode in zip(self.prefix, modes):
                m.train(mode)
        return h


def _attended(row: Tensor, pad: int) -> int:
    """The length of a right-padded row: up to its last token that is not padding (at least 1)."""
    keep = (row != pad).nonzero()
    return int(keep[-1]) + 1 if len(keep) else 1


def _cached_embeddings(cache: PrefixCache):
    def forward(self, input_ids=None, token_type_ids=None, position_ids=None, inputs_embeds=None, **kwargs):
        if input_ids is None or position_ids is not None or inputs_embeds is not None:
            raise ValueError("model.seqcls.prefix_cache serves forwards from input_ids only")
        return cache.lookup(input_ids, token_type_ids)

    return forward


def _pass_through(self, hidden_states, *args, **kwargs):
    return hidden_states
