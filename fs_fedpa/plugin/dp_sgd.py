"""Sample-level DP-SGD on a client (``fedpa.dp.mode: sample``) as FS train hooks, for any trainer built on
``GeneralTorchTrainer`` (FS-LLM's ``llmtrainer`` and the plugin's ``seqcls``).

At every step, in place of the batch FS's shuffled, cycled loader gave (which matches no sampling an accountant
knows): b of the client's n_i records drawn uniformly without replacement from the DP generator, or each record at
rate b/n_i (``fedpa.dp.sampling poisson``, b then the expected size); the gradient of each
record's task loss over every tensor that trains (LoRA factors and head; a head held at its initial value by
``fedpa.dp.local_tensors frozen`` takes no step) clipped to C; the sum plus N(0, (z C)^2),
divided by b, is the step's task gradient. With ``fedpa.dp.local_tensors grouped`` the local tensors are a clipping
group of their own: each record's part there is clipped to C_h (``fedpa.dp.local_clip``), the rest to C, and each group
is noised at z_g C_g with z_g = z sqrt(2) (:attr:`~fs_fedpa.privacy.sample_plan.SamplePlan.z_group`).
What does not touch the data, FedPA-LoRA's alignment term at a fixed lambda
and FS's parameter regularizer, is differentiated as usual and added after clipping and noise.

The per-example gradients come from batched forwards and backwards with taps on the trainable ``nn.Linear`` modules
(:mod:`fs_fedpa.privacy.per_example`; the whole batch on an accelerator, on a CPU chunks of ``fedpa.dp.chunk`` (default
CPU_CHUNK) length-sorted records, each chunk clipped and added to the step's sum as it comes, so a logical batch of
any b needs the memory of one chunk's per-example gradients) when every trainable tensor is such a module's and the
trainer's loss is a mean of per-record losses this module can rebuild from the logits; otherwise, and on any chunk
where the taps' sum misses autograd's gradient, from a per-example loop (FS's forward on each record alone;
``torch.func.vmap`` fails inside transformers' attention-mask code). Both give the same clipped sum
(tests/integration/test_dp_sgd_fs.py).
"""

from __future__ import annotations

import copy
import logging

import torch
import torch.nn.functional as F
from federatedscope.core.trainers.context import CtxVar
from federatedscope.core.trainers.enums import LIFECYCLE
from torch import Tensor

from fs_fedpa.core.batches import length_chunks, select_records
from fs_fedpa.plugin import fs_patches
from fs_fedpa.privacy.mechanism import (
    add_clipped,
    add_clipped_groups,
    gaussian_flat,
    gaussian_groups,
    sample_poisson,
    sample_without_replacement,
)
from fs_fedpa.privacy.per_example import (
    LinearTaps,
    clipped_sum_flat,
    clipped_sum_groups,
    column_groups,
    describe_gaps,
    linear_owners,
    per_example_matrix,
    sum_gaps,
    sum_mismatch,
)

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only
CPU_CHUNK = 4  # records a batched forward takes on the CPU (research/benchmarks/bench_dp_sgd.py)


class DPSGD:
    """The hooks of one client's trainer; ``plan(n)`` gives the client's
    :class:`~fs_fedpa.privacy.sample_level.SamplePlan` for its training set size, ``make_generator(k)`` its DP
    generator for the k-th training routine of the current round (a fresh stream per routine: with ``fedpa.dp.seed`` a
    resumed run draws what the uninterrupted one drew, and in distributed mode the stream is named by the id the
    client learns when it joins). ``local`` names the tensors clipped as their own group to ``local_clip`` (0:
    ``clip``; ``fedpa.dp.local_tensors grouped``)."""

    def __init__(self, trainer, plan, make_generator, clip: float, batched: bool = True, chunk: int | None = None,
                 frozen: frozenset[str] = frozenset(), local: frozenset[str] = frozenset(),
                 local_clip: float = 0.0):  # fmt: skip
        # Every tensor that moves is clipped and noised; ``frozen`` names trainable tensors held at their value
        # (fedpa.dp.local_tensors frozen). None may train on the exact gradient (the withdrawn 'plain'): through it
        # one record would move every other record's clipped gradient, and a step's sensitivity would not be 2C
        self.plan, self.C = plan, clip
        self.frozen = frozenset(frozen)
        self.local, self.C_local = frozenset(local), float(local_clip or clip)
        if self.local & self.frozen:
            raise ValueError(f"DP-SGD: tensors both frozen and grouped: {sorted(self.local & self.frozen)}")
        self.batched = batched  # per-example gradients from batched backwards; False: the per-example loop
        # records a batched forward takes on a CPU (None: CPU_CHUNK); an accelerator takes the whole batch
        self.chunk = chunk
        self._owners = None  # (ids of the model and its trainable tensors, their nn.Linear owners, why not, model)
        self._make_generator, self._generator = make_generator, None
        self.round_steps = 0  # DP steps of the round: never more than its plan, which the accounting covers
        self.round_nonfinite = 0  # records of the round whose gradient norm was not finite: they contributed zero
        self.round_empty = 0  # steps of the round whose Poisson draw held no record
        # per step of the round, (||clipped sum||^2, ||noise||^2) over the clipped tensors, as 0-d tensors read only
        # by signal_noise (no host sync in the step): how far the noise drowns the signal. Computed from the client's
        # records, so a local diagnostic for its own log, never sent
        self.round_norms: list[tuple[Tensor, Tensor]] = []
        # the step's clipped sum, float64: every tensor DP-SGD trains, flattened one after the other (params' order)
        self._grad_flat: Tensor | None = None
        self._shapes: list[torch.Size] = []
        self._plan = None
        self._empty = False  # this step's Poisson draw was empty
        self._routine = 0
        try:  # FS's own forward is called on each chunk; its backward is replaced below
            self._forward = fs_patches.train_hook(trainer, "on_batch_forward", "_hook_on_batch_forward")
            fs_patches.train_hook(trainer, "on_batch_backward", "_hook_on_batch_backward")
        except ValueError as err:
            raise ValueError(f"fedpa.dp.mode sample needs FS's forward and backward train hooks: {err}") from None
        trainer.register_hook_in_train(new_hook=self._hook_on_batch_start_dp_sample, trigger="on_batch_start")
        trainer.replace_hook_in_train(self._hook_on_batch_forward_dp, "on_batch_forward", "_hook_on_batch_forward")
        trainer.replace_hook_in_train(self._hook_on_batch_backward_dp, "on_batch_backward", "_hook_on_batch_backward")
        trainer.register_hook_in_train(new_hook=self._hook_on_fit_start_dp, trigger="on_fit_start")
        trainer.register_hook_in_train(new_hook=self._hook_on_fit_end_dp, trigger="on_fit_end", insert_pos=0)

    @property
    def plan_in_use(self):
        """The :class:`~fs_fedpa.privacy.sample_level.SamplePlan` of the client's last DP-SGD step (None before its
        first)."""
        return self._plan

    @property
    def _grad_sum(self) -> list[Tensor]:
        """The step's clipped sum, one float64 tensor a trained tensor (views of the flat sum)."""
        if self._grad_flat is None:
            return []
        sizes = [s.numel() for s in self._shapes]
        return [t.view(s) for t, s in zip(self._grad_flat.split(sizes), self._shapes)]

    def _keep_sum(self, flat: Tensor | None, params) -> None:
        self._grad_flat, self._shapes = flat, [p.shape for p in params]

    @property
    def generator(self) -> torch.Generator:
        if self._generator is None:
            self._generator = self._make_generator(0)
        return self._generator

    def new_round(self) -> None:
        """Called when the client enters a round: its routines count from 0 again."""
        self._routine = 0
        self.round_steps = 0
        self.round_nonfinite = 0
        self.round_empty = 0
        self.round_norms = []

    def signal_noise(self) -> tuple[float, float] | None:
        """The round's mean ||clipped sum|| and mean ||noise|| per step (None before a step): the noise's share
        of each step is the second over the first. Local only (it reads the client's records)."""
        if not self.round_norms:
            return None
        signal, noise = torch.tensor([[float(s), float(n)] for s, n in self.round_norms], dtype=torch.float64).sqrt().T
        return float(signal.mean()), float(noise.mean())

    def _hook_on_fit_start_dp(self, ctx):
        self._generator = self._make_generator(self._routine)
        self._routine += 1

    def _hook_on_fit_end_dp(self, ctx):
        """A routine whose every Poisson draw was empty trained on no record; FS's average loss divides by the
        records seen, so it is told of one (with loss 0) rather than fail the client's round."""
        if ctx.get("num_samples") == 0 and self._empty:
            ctx.num_samples = CtxVar(1, LIFECYCLE.ROUTINE)

    def _hook_on_batch_start_dp_sample(self, ctx):
        """Replace FS's batch by b records drawn without replacement, or by each record at rate b/n (Poisson): the
        event the accountant composes. A Poisson draw may be empty; the step is then the noise alone, and the batch
        FS sees is one record that the forward hook only looks at for the shapes of its outputs."""
        loader = ctx.get(f"{ctx.cur_split}_loader")
        loader = getattr(loader, "loader", loader)  # FS's ReIterator around a torch DataLoader
        n = len(loader.dataset)
        plan = self._plan = self.plan(n)
        if plan.sampling == "poisson":
            chosen = sample_poisson(n, plan.b / n, self.generator)
        else:
            chosen = sample_without_replacement(n, plan.b, self.generator)
        self._empty = not chosen
        self.round_empty += self._empty
        ctx.data_batch = CtxVar(loader.collate_fn([loader.dataset[j] for j in chosen or [0]]), LIFECYCLE.BATCH)

    def _hook_on_batch_forward_dp(self, ctx):
        """The clipped sum of the batch's per-example gradients, kept for the backward hook. ``ctx.loss_batch`` is the
        mean of the records' losses, detached (the client's own log; it is never sent)."""
        batch = ctx.data_batch
        size = _batch_size(batch)
        params = self._params(ctx.model)
        if self._empty:
            self._no_records(ctx, params)
            return
        if not (self.batched and self._batched(ctx, batch, size, params)):
            self._loop(ctx, batch, size, params)
        ctx.data_batch = CtxVar(batch, LIFECYCLE.BATCH)
        ctx.batch_size = CtxVar(size, LIFECYCLE.BATCH)
        ctx.skip_this_batch = CtxVar(False, LIFECYCLE.BATCH)  # FS-LLM's NaN retry would take an unaccounted step

    def _no_records(self, ctx, params) -> None:
        """An empty Poisson draw: a clipped sum of zero and a batch of size 0 (the one record FS's batch holds gives
        the outputs' shapes and is dropped)."""
        with torch.no_grad():
            self._forward(ctx)
        self._keep_sum(torch.zeros(sum(p.numel() for p in params), dtype=torch.float64, device=_device(ctx.model)),
                       params)  # fmt: skip
        ctx.loss_batch = CtxVar(torch.zeros((), device=_device(ctx.model)), LIFECYCLE.BATCH)
        ctx.y_true = CtxVar(ctx.y_true[:0], LIFECYCLE.BATCH)
        ctx.y_prob = CtxVar(ctx.y_prob[:0], LIFECYCLE.BATCH)
        ctx.batch_size = CtxVar(0, LIFECYCLE.BATCH)
        ctx.skip_this_batch = CtxVar(False, LIFECYCLE.BATCH)

    def _batched(self, ctx, batch, size: int, params) -> bool:
        """Forwards of the batch's records in chunks with taps, one backward each of the sum of the chunk's losses;
        False (nothing kept) when this batch must take the loop; ``self.batched`` turns off for good when no batch of
        this trainer can. On the CPU a chunk holds records of similar length: a padded forward computes over its
        longest record, so chunks of 4 length-sorted records cost less than one forward of 16."""
        owners, why = self._linear_owners(ctx.model, params)
        if owners is None:
            return self._give_up(why)
        chunk = size if _device(ctx.model).type != "cpu" else (self.chunk or CPU_CHUNK)
        sizes = [p.numel() for p in params]
        columns = column_groups(tuple(sizes), self._groups(ctx.model), _device(ctx.model)) if self.local else None
        total, dropped, losses, y_true, y_prob = None, 0, [], [], []
        for index in length_chunks(batch, size, chunk):
            n = len(index)
            ctx.data_batch = CtxVar(select_records(batch, index, size), LIFECYCLE.BATCH)
            with LinearTaps([m for m, _ in owners]) as taps:
                self._forward(ctx)
            loss = ctx.get("loss_batch")
            part, mean, why = record_losses(ctx, n)
            if part is None:
                if isinstance(loss, Tensor) and not bool(torch.isfinite(loss).all()):
                    return False  # as below: a non-finite loss takes the loop before anything else is asked
                return self._give_up(why)
            # what decides whether this chunk's sum is kept is computed on the device and read once, after the clip
            # (one host sync a chunk): the loss's and the records' losses' finiteness, their agreement, the sum check
            grads = torch.autograd.grad(part.sum(), params + taps.outputs(), allow_unused=True)
            found = per_example_matrix(taps, owners, grads[len(params) :], n)
            if found is None:
                return self._give_up("a tapped module's input is not split by record along its first dimension")
            low = any(x.dtype in (torch.float16, torch.bfloat16) for calls in taps.calls.values() for x, _ in calls)
            rtol = 5e-2 if low else 1e-3
            gaps = sum_gaps(found, grads[: len(params)], sizes)
            # clipped chunk by chunk: the clip is per record, so the sum is the same, and only one chunk's
            # per-example gradients are alive at a time (a logical batch of b records in bounded memory)
            if columns is None:
                part_sum, scales = clipped_sum_flat(found, self.C)
            else:
                part_sum, scales = clipped_sum_groups(found, columns, self.clips)
                scales = scales.amin(1)  # 0 only where the record's norm was not finite
            del found, grads
            flags = torch.stack([~torch.isfinite(loss).all(), ~_agrees(mean, loss), ~torch.isfinite(part).all(),
                                 sum_mismatch(gaps, rtol), (scales == 0).sum()])  # fmt: skip
            loss_nonfinite, differs, part_nonfinite, mismatch, zeros = flags.tolist()
            if loss_nonfinite:
                return False  # e.g. a causal-LM chunk without a label token: the loop gives each record zero
            if differs:
                return self._give_up(_disagreement(mean, loss))
            if part_nonfinite:
                return False  # the loop gives a non-finite record zero, within the clip bound
            if mismatch:
                return self._give_up(
                    f"the per-example gradients do not sum to the chunk's gradient ({describe_gaps(gaps, rtol)})",
                    warn=True,
                )
            total = part_sum if total is None else total.add_(part_sum)
            dropped += zeros  # c_j = 0 only for a non-finite norm (C > 0)
            losses.append(part.detach())
            y_true.append(ctx.y_true.detach())
            y_prob.append(ctx.y_prob.detach())
        self._keep_sum(total, params)
        self.round_nonfinite += dropped
        ctx.loss_batch = CtxVar(torch.cat(losses).mean(), LIFECYCLE.BATCH)
        ctx.y_true = CtxVar(torch.cat(y_true), LIFECYCLE.BATCH)  # in chunk order: the client's own metrics
        ctx.y_prob = CtxVar(torch.cat(y_prob), LIFECYCLE.BATCH)
        return True

    def _linear_owners(self, model, params):
        """:func:`~fs_fedpa.privacy.per_example.linear_owners`, walked again only when the trainable tensors change
        (not at every step)."""
        key = (id(model), tuple(id(p) for p in params))
        if self._owners is None or self._owners[0] != key:
            # the model is kept with its key, so its id cannot name another model while the entry lives
            self._owners = (key, *linear_owners(model, params), model)
        return self._owners[1:3]

    def _params(self, model) -> list[Tensor]:
        """The tensors DP-SGD trains: the trainable ones less ``self.frozen``."""
        return [p for n, p in model.named_parameters() if p.requires_grad and n not in self.frozen]

    def _groups(self, model) -> tuple[int, ...]:
        """The clipping group of each tensor of :meth:`_params`: 1 for a ``self.local`` one, else 0."""
        return tuple(int(n in self.local) for n, p in model.named_parameters()
                     if p.requires_grad and n not in self.frozen)  # fmt: skip

    @property
    def clips(self) -> tuple[float, ...]:
        """The clip of each group: C, and C_h where the local tensors are their own group."""
        return (self.C, self.C_local) if self.local else (self.C,)

    def _give_up(self, why: str, warn: bool = False) -> bool:
        self.batched = False
        (logger.warning if warn else logger.info)(f"DP-SGD: per-example gradients from a per-example loop: {why}")
        return False

    def _loop(self, ctx, batch, size: int, params) -> None:
        """Per record: FS's forward on it alone and the gradient of its loss, clipped into the running sum."""
        total, losses, y_true, y_prob = None, [], [], []
        groups = self._groups(ctx.model) if self.local else None
        for j in range(size):  # one record's gradient alive at a time
            ctx.data_batch = CtxVar(_row(batch, j, size), LIFECYCLE.BATCH)
            self._forward(ctx)
            if torch.isfinite(ctx.loss_batch):
                grads = torch.autograd.grad(ctx.loss_batch, params, allow_unused=True)
            else:  # e.g. a causal-LM record with no label token: it contributes zero, within the clip bound
                grads = [None] * len(params)
            grads = [torch.zeros_like(p) if g is None else g.detach() for g, p in zip(grads, params)]
            if groups is None:
                total, c = add_clipped(total, grads, self.C)
            else:
                total, c = add_clipped_groups(total, grads, groups, self.clips)
            self.round_nonfinite += c == 0.0
            losses.append(ctx.loss_batch.detach())
            y_true.append(ctx.y_true.detach())
            y_prob.append(ctx.y_prob.detach())
        self._keep_sum(torch.cat([t.flatten() for t in total]) if size and total else None, params)
        ctx.loss_batch = CtxVar(torch.stack(losses).mean(), LIFECYCLE.BATCH)
        ctx.y_true = CtxVar(torch.cat([y.reshape(-1, *y.shape[1:]) if y.ndim else y.reshape(1) for y in y_true]),
                            LIFECYCLE.BATCH)  # fmt: skip
        ctx.y_prob = CtxVar(torch.cat(y_prob), LIFECYCLE.BATCH)

    def _hook_on_batch_backward_dp(self, ctx):
        """grad = d(alignment + regularizer) + (clipped sum + N(0, (z C)^2)) / b, then FS's optimizer step (per
        clipping group N(0, (z_g C_g)^2))."""
        plan = self._plan
        if plan.groups != len(self.clips):
            raise RuntimeError(
                f"DP-SGD clips {len(self.clips)} group(s) but its plan's noise is for {plan.groups}: the accounting "
                "would not cover the step"
            )
        self.round_steps += 1
        if self.round_steps > plan.steps_per_round:
            raise RuntimeError(
                f"DP-SGD took {self.round_steps} steps in a round planned for {plan.steps_per_round}: the privacy "
                "accounting would not cover them"
            )
        ctx.optimizer.zero_grad()
        if isinstance(ctx.loss_task, Tensor) and ctx.loss_task.requires_grad:
            ctx.loss_task.backward()  # the data-free terms: ctx.loss_batch is detached
        if self.frozen:  # not walked on every step of a run that freezes nothing
            for n, p in ctx.model.named_parameters():
                if n in self.frozen:
                    p.grad = None  # e.g. a regularizer's gradient: a frozen tensor takes no step at all
        params = self._params(ctx.model)
        flat = self._grad_flat
        with torch.no_grad():
            if flat is None:  # no tensor trains
                signal = noise = 0.0
            else:
                # the noise of every tensor in one flat buffer (the generator's numbers as one draw a tensor), one
                # copy to the device; the norms and the step a few operations on the flat sum, not a few a tensor
                sizes = [p.numel() for p in params]
                if self.local:
                    stds = [plan.z_group * self.clips[g] for g in self._groups(ctx.model)]
                    drawn = gaussian_groups(sizes, stds, self.generator, flat)
                else:
                    drawn = gaussian_flat(sizes, plan.z * self.C, self.generator, flat)
                signal, noise = flat.dot(flat), drawn.dot(drawn)
                step = flat.add_(drawn).div_(plan.b)  # the sum is spent: (sum + noise) / b in its place
                dtypes = {p.dtype for p in params}
                step = step.to(dtypes.pop()) if len(dtypes) == 1 else step
                for p, g in zip(params, step.split([p.numel() for p in params])):
                    g = g.view(p.shape).to(p.dtype)
                    p.grad = g if p.grad is None else p.grad + g
        self.round_norms.append((signal, noise))
        self._grad_flat = None
        ctx.optimizer.step()
        if ctx.scheduler is not None:
            ctx.scheduler.step()


def _agrees(mean: Tensor, loss: Tensor) -> Tensor:
    """0-d bool, on the device: the records' mean loss is the trainer's batch loss."""
    return torch.isclose(mean.detach(), loss.detach().float(), rtol=1e-4, atol=1e-6).all()


def _disagreement(mean: Tensor, loss: Tensor) -> str:
    return f"the batch loss {float(loss):.6g} is not the mean {float(mean):.6g} of the records' losses"


def record_losses(ctx, size: int) -> tuple[Tensor | None, Tensor | None, str]:
    """``(b,)``: each record's task loss as its own forward would give it, from the batch forward's logits
    (``ctx.y_prob``) and labels (``ctx.y_true``), and their mean, which ``ctx.loss_batch`` must be (:func:`_agrees`,
    checked by the caller with the chunk's other flags, no host read here); or None, None and why, when the logits,
    labels and loss are not in one of the two forms known here: a causal LM's mean over label tokens (FS-LLM's
    ``llmtrainer``; a record's loss is the mean over its own label tokens, 0 with none), or ``ctx.criterion``
    averaged over records (FS's general trainer, the plugin's ``seqcls``)."""
    logits, labels, loss = ctx.get("y_prob"), ctx.get("y_true"), ctx.get("loss_batch")
    if not all(isinstance(t, Tensor) for t in (logits, labels, loss)):
        return None, None, "the trainer's forward leaves no logits, labels and loss tensors"
    if logits.ndim == 3 and labels.ndim == 2 and logits.shape[:2] == labels.shape and labels.shape[0] == size:
        tokens = F.cross_entropy(logits[:, :-1].flatten(0, 1).float(), labels[:, 1:].flatten(), ignore_index=-100,
                                 reduction="none").view(size, -1)  # fmt: skip
        count = (labels[:, 1:] != -100).sum(1)
        losses, mean = tokens.sum(1) / count.clamp(min=1), tokens.sum() / count.sum().clamp(min=1)
    else:
        criterion = ctx.get("criterion")
        if not isinstance(criterion, torch.nn.modules.loss._Loss):
            return None, None, f"criterion {type(criterion).__name__} is not a torch loss with a reduction"
        per_record = copy.copy(criterion)
        per_record.reduction = "none"
        losses = per_record(logits, labels)
        if losses.ndim == 0 or losses.shape[0] != size:
            return None, None, f"the criterion's unreduced loss has shape {tuple(losses.shape)}, not ({size}, ...)"
        losses = losses.reshape(size, -1).float().mean(1)
        mean = losses.mean()
    return losses, mean, ""


def _batch_size(batch) -> int:
    for t in _tensors(batch):
        return int(t.shape[0])
    raise ValueError("DP-SGD: a batch without tensors")


def _tensors(batch):
    if isinstance(batch, Tensor):
        yield batch
    elif isinstance(batch, dict):
        for v in batch.values():
            yield from _tensors(v)
    elif isinstance(batch, (list, tuple)):
        for v in batch:
            yield from _tensors(v)


def _device(model) -> torch.device:
    return next(model.parameters()).device


def _row(batch, j: int, size: int):
    """Record ``j`` of a batch, as a batch of one."""
    return select_records(batch, torch.tensor([j]), size)
