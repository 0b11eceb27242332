"""A client's logit correction in FS's trainer (``fedpa.dp.label_prior``): b ``(K,)``, which its DP policy gives
(:meth:`~fs_fedpa.privacy.policy.ClientPolicy.logit_bias`), added to its model's logits in every forward of a
training or evaluation routine, by a forward hook held for the routine only (a model FS shares between clients
never carries another client's b). The trainer's logits (``ctx.y_prob``), its loss and DP-SGD's per-record losses
(:func:`fs_fedpa.plugin.dp_sgd.record_losses`) are then all of the corrected logits."""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch import Tensor


def add_logit_bias(model: torch.nn.Module, bias: Tensor):
    """A forward hook adding ``bias`` to ``model``'s output: a logits tensor ``(..., K)`` or an HF output's
    ``logits``. Returns its handle."""

    def hook(module, args, output):
        if isinstance(output, Tensor):
            return output + bias.to(output.device, output.dtype)
        output.logits = output.logits + bias.to(output.logits.device, output.logits.dtype)
        return output

    return model.register_forward_hook(hook)


def training_labels(ctx) -> Tensor:
    """``(n_i,)``: the labels of the client's training split (records ``(features, label)``, as the seqcls data)."""
    loader = ctx.get("train_loader")
    dataset = getattr(loader, "loader", loader).dataset  # FS's ReIterator around a torch DataLoader
    return torch.as_tensor([int(dataset[j][1]) for j in range(len(dataset))])


def install_logit_bias(trainer, bias_of: Callable[[Callable[[], Tensor], bool], Tensor | None]) -> None:
    """At each routine's start, ``bias_of(labels, training)`` (``labels()``: :func:`training_labels`) hooked into
    ``ctx.model`` where it is not None; removed at the routine's end (or at the next start, after a failed one)."""
    handles = []

    def remove(ctx=None):
        while handles:
            handles.pop().remove()

    def start(training: bool):
        def hook(ctx):
            remove()
            bias = bias_of(lambda: training_labels(ctx), training)
            if bias is not None:
                handles.append(add_logit_bias(ctx.model, bias))

        return hook

    trainer.register_hook_in_train(new_hook=start(True), trigger="on_fit_start")
    trainer.register_hook_in_train(new_hook=remove, trigger="on_fit_end")
    trainer.register_hook_in_eval(new_hook=start(False), trigger="on_fit_start")
    trainer.register_hook_in_eval(new_hook=remove, trigger="on_fit_end")
