"""``model.seqcls.pack_len``: a BERT-style encoder forwards each right-padded batch with its records packed whole
into rows of ``pack_len`` positions (:mod:`fs_fedpa.core.packing`): position ids restart at each record, attention is
block-diagonal, and the encoder's output is put back in the padded layout (zeros at padding) before the pooler and
the head, so the classifier reads what it reads without packing. No FS import: it hooks an HF model.

Exactness: a record's logits and gradients are those of the padded forward up to float summation order (a masked key
weighs exactly 0); dropout draws its masks on the packed shape, so a training step is the padded one in distribution,
as with chunked forwards. Speed (CPU, MiniLM, SST-2 batches of 32, 14 tokens a record on average, 41 padded): the
dense layers run on about 14 positions a record in one large matrix product instead of 41, or of small chunks
(research/benchmarks/bench_main_job.py).
"""

from __future__ import annotations

import logging

import torch
from torch import nn

from fs_fedpa.core.packing import Packing, right_padded
from fs_fedpa.plugin.prefix_cache import encoder_of

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


class SequencePacking:
    """Installed on ``model``'s encoder (a module with ``embeddings`` and ``encoder.layer``) as a forward pre-hook
    that packs ``input_ids``/``token_type_ids`` and a forward hook that unpacks ``last_hidden_state`` and recomputes
    ``pooler_output`` (and ``hidden_states`` when asked for; ``attentions`` stay in the packed layout). A batch that
    is not right-padded, has an empty record, or comes as embeddings, is forwarded as it is. ``packed``/``plain``
    count the batches."""

    def __init__(self, model: nn.Module, budget: int):
        encoder = encoder_of(model)
        if encoder is None:
            raise ValueError("model.seqcls.pack_len needs a BERT-style encoder (embeddings and encoder.layer)")
        config = encoder.config
        if getattr(config, "position_embedding_type", None) not in (None, "absolute"):
            raise ValueError(
                f"model.seqcls.pack_len needs absolute position embeddings; this model's are "
                f"{config.position_embedding_type!r}: set pack_len 0"
            )
        if config._attn_implementation not in ("sdpa", "eager"):
            raise ValueError(
                f"model.seqcls.pack_len needs the sdpa or eager attention, not {config._attn_implementation!r}: set "
                "pack_len 0"
            )
        self.budget = budget
        # RoBERTa-style embeddings number positions from padding_idx + 1 and give padding padding_idx; BERT from 0
        self.first_position = getattr(encoder.embeddings, "padding_idx", None)
        self.packing: Packing | None = None
        self.packed = self.plain = 0
        encoder.register_forward_pre_hook(self._pack, with_kwargs=True)
        encoder.register_forward_hook(self._unpack, with_kwargs=True)
        logger.info(f"[fedpa] sequence packing: records packed whole into rows of {budget} positions")

    def _pack(self, module: nn.Module, args: tuple, kwargs: dict):
        ids = args[0] if args else kwargs.get("input_ids")
        mask = kwargs.get("attention_mask")
        self.packing = None
        given = ids is not None and mask is not None and mask.ndim == 2 and len(args) <= 1
        others = kwargs.get("position_ids") is not None or kwargs.get("inputs_embeds") is not None
        # an empty record (no attended token) would get no row of its own
        if not given or others or not right_padded(mask) or not mask.any(1).all():
            self.plain += 1
            return None
        packing = self.packing = Packing.of(mask, self.budget)
        self.packed += 1
        positions = packing.offset
        if self.first_position is not None:
            positions = torch.where(packing.segment >= 0, positions + self.first_position + 1, self.first_position)
        allowed = packing.attention()
        if module.config._attn_implementation == "eager":  # eager adds the mask to the scores
            dtype = module.dtype if module.dtype.is_floating_point else torch.float32
            allowed = torch.zeros(allowed.shape, dtype=dtype, device=ids.device).masked_fill_(
                ~allowed, torch.finfo(dtype).min
            )
        types = kwargs.get("token_type_ids")
        kwargs = dict(kwargs, input_ids=packing.pack(ids, fill=module.config.pad_token_id or 0))
        kwargs.update(position_ids=positions, attention_mask=allowed)
        kwargs["token_type_ids"] = packing.pack(types) if types is not None else None
        return (), kwargs

    def _unpack(self, module: nn.Module, args: tuple, kwargs: dict, output):
        packing, self.packing = self.packing, None
        if packing is None:
            return output
        hidden = packing.unpack(output[0])
        pooled = module.pooler(hidden) if getattr(module, "pooler", None) is not None else None
        if isinstance(output, tuple):
            return (hidden, pooled, *output[2:]) if pooled is not None else (hidden, *output[1:])
        output.last_hidden_state = hidden
        if pooled is not None:
            output.pooler_output = pooled
        if getattr(output, "hidden_states", None) is not None:  # output_hidden_states: each layer's, unpacked too
            output.hidden_states = tuple(packing.unpack(h) for h in output.hidden_states)
        return output
