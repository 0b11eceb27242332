"""An empirical lower bound on the epsilon of the plugin's DP-SGD, from a gradient canary (the white-box auditing of
Nasr et al., IEEE S&P 2021, in the Monte-Carlo form of Jagielski et al., NeurIPS 2020), one bound per treatment of
the client's local head (``fedpa.dp.local_tensors``), and for the withdrawn 'plain' head as an emulation.

The audited mechanism is the plugin's own DP-SGD hooks (:class:`fs_fedpa.plugin.dp_sgd.DPSGD`) in FS's
``GeneralTorchTrainer`` on a two-layer model (a body, which DP-SGD trains and the client releases, and a local
head): ``--steps`` full-batch steps (b = n, so no sampling amplification), replace-one adjacency, z calibrated by the
plugin's accountant so that the ledger states ``--epsilon`` at ``--delta``. The neighbouring dataset replaces one
record by a far-off canary. The auditor sees what the client releases, each step's noised gradient of the body (the
body's lr is 0, so every step is taken at the same point and the releases are the step's noisy sums divided by b),
and knows both datasets. Its test is the likelihood-ratio test of that pair: the projection of the releases on the
difference of their noise-free values, thresholded at a value chosen on a first half of the trials; Clopper-Pearson
bounds (95 % overall) on its false-positive and false-negative rates over the second half give

    epsilon_lb = max(log((1 - delta - FNR_hi) / FPR_hi), log((1 - delta - FPR_hi) / FNR_hi)).

'plain' is emulated as it ran: the head on the batch's exact mean-loss gradient (at :class:`Audit`'s ``head_lr``,
1 from the command line), outside the mechanism. What a bound says: with 95 % confidence the mechanism's epsilon at that delta is at least epsilon_lb. A
bound below the ledger's epsilon is consistent with the guarantee but does not prove it (another pair of datasets or
another test could do better); a bound above it shows that the stated epsilon is no guarantee. What a trial count can
show is printed first (:func:`detection_line`): the largest bound it can give (:func:`ceiling`; 6.3 at the default
4,000 trials) and the smallest violation it can flag (:func:`detection_limit`; at the default ledger epsilon 1, a
true epsilon of about 2.8, at best). A bound of 0.000 means no violation of that size, not that the ledger holds.

    python -m research.tools.dp_audit [--trials 4000] [--epsilon 1] [--steps 2]
"""

from __future__ import annotations

import logging
import math
import sys

from fs_fedpa.tools import cli

TREATMENTS = ("noised", "frozen", "plain")
HEAD = frozenset({"1.weight", "1.bias"})


def clopper_pearson_upper(k: int, n: int, alpha: float) -> float:
    """The one-sided (1 - alpha) upper bound on a rate seen k times in n trials."""
    from scipy.stats import beta

    return 1.0 if k >= n else float(beta.ppf(1 - alpha, k + 1, n - k))


def epsilon_lower_bound(null, alt, threshold: float, delta: float, alpha: float = 0.05) -> float:
    """epsilon_lb from the test 'statistic > threshold' over samples ``null`` (dataset D) and ``alt`` (D'); each
    rate's bound at alpha/2, so the pair holds at 1 - alpha."""
    fp = int((null > threshold).sum())
    fn = int((alt <= threshold).sum())
    fpr = clopper_pearson_upper(fp, len(null), alpha / 2)
    fnr = clopper_pearson_upper(fn, len(alt), alpha / 2)
    best = 0.0
    for a, b in ((fnr, fpr), (fpr, fnr)):
        if 1 - delta - a > 0:
            best = max(best, math.log((1 - delta - a) / b))
    return best


def ceiling(trials: int, delta: float, alpha: float = 0.05) -> float:
    """The largest epsilon_lb that ``trials`` per dataset can give: no error on either side of the second halves
    (m = trials - trials // 2 a side), so each rate's upper bound is 1 - (alpha/2)^(1/m)."""
    m = trials - trials // 2
    rate = clopper_pearson_upper(0, m, alpha / 2)
    return max(0.0, math.log((1 - delta - rate) / rate))


def _expected_bound(mu: float, trials: int, delta: float, alpha: float) -> float:
    """epsilon_lb of the test at its best threshold t on a shift of ``mu`` noise standard deviations, the error
    counts at their expectations m FPR(t), m FNR(t) (Clopper-Pearson through the beta quantile, which takes a
    fractional count)."""
    import numpy as np
    from scipy.stats import beta, norm

    m = trials - trials // 2
    t = np.linspace(-4.0, mu + 8.0, 4001)
    fpr, fnr = norm.sf(t), norm.cdf(t - mu)
    a = alpha / 2

    def upper(rate):
        k = np.minimum(m * rate, m - 1e-9)
        return beta.ppf(1 - a, k + 1, m - k)

    fp, fn = upper(fpr), upper(fnr)
    with np.errstate(divide="ignore", invalid="ignore"):
        both = np.maximum(np.log((1 - delta - fn) / fp), np.log((1 - delta - fp) / fn))
    return float(max(0.0, np.nanmax(both)))


def gaussian_epsilon(mu: float, delta: float) -> float:
    """epsilon at ``delta`` of the pair N(mu, 1), N(0, 1): delta(eps) = Phi(mu/2 - eps/mu) - e^eps Phi(-mu/2 -
    eps/mu) (Balle and Wang, ICML 2018)."""
    from scipy.optimize import brentq
    from scipy.stats import norm

    def gap(eps):
        return norm.cdf(mu / 2 - eps / mu) - math.exp(eps) * norm.cdf(-mu / 2 - eps / mu) - delta

    return 0.0 if gap(0.0) <= 0 else brentq(gap, 0.0, mu * mu / 2 + 10 * mu + 10)


def detection_limit(trials: int, target: float, delta: float, alpha: float = 0.05) -> dict | None:
    """The smallest violation the audit can flag at ``trials`` per dataset: the smallest shift mu (in noise standard
    deviations, along the test's direction) at which its expected epsilon_lb exceeds ``target``, and the epsilon at
    ``delta`` of the Gaussian mechanism with that shift, the true epsilon of the game there. The best case for the
    auditor (the best threshold, the error counts at their expectation): a smaller violation is missed. None where
    ``target`` is at or above :func:`ceiling`: no outcome of the audit exceeds it."""
    if target >= ceiling(trials, delta, alpha):
        return None
    lo, hi = 0.0, 1.0
    while _expected_bound(hi, trials, delta, alpha) <= target:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-4 * hi:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if _expected_bound(mid, trials, delta, alpha) <= target else (lo, mid)
    return {"mu": hi, "epsilon": gaussian_epsilon(hi, delta)}


def detection_line(trials: int, target: float, delta: float) -> str:
    """What a result of the audit at ``trials`` per dataset can say about a ledger of ``target`` at ``delta``."""
    top = ceiling(trials, delta)
    head = (f"detection at {trials} trials per dataset (95 %): epsilon_lb is at most {top:.3f} (no error in "
            f"{trials - trials // 2} trials a side)")  # fmt: skip
    limit = detection_limit(trials, target, delta)
    if limit is None:
        return (f"{head}, not above the ledger's {target:g}: this audit cannot flag any violation; raise "
                "--trials")  # fmt: skip
    return (f"{head}; it exceeds the ledger's {target:g} only where the canary moves the releases by "
            f"{limit['mu']:.3g} noise sd or more, a true epsilon of {limit['epsilon']:.3g} "
            f"({limit['epsilon'] / target:.3g} x the ledger's) at best. A bound below the ledger, 0.000 included, "
            "means no violation that large, not that the ledger holds.")  # fmt: skip


class Audit:
    """One treatment's auditing game on the plugin's DP-SGD; :meth:`trial_releases` runs ``trials`` of it."""

    def __init__(self, treatment: str, z: float, steps: int, clip: float, n: int = 64, head_lr: float = 1.0):
        if treatment not in TREATMENTS:
            raise ValueError(f"treatment {treatment!r} must be one of {TREATMENTS}")
        self.treatment, self.z, self.steps, self.C, self.n, self.head_lr = treatment, z, steps, clip, n, head_lr

    def _trainer(self, canary: bool):
        import torch
        from federatedscope.core.configs.config import global_cfg
        from federatedscope.core.monitors.monitor import Monitor
        from federatedscope.core.trainers import GeneralTorchTrainer
        from torch.utils.data import DataLoader, TensorDataset

        cfg = global_cfg.clone()
        cfg.merge_from_list(["train.optimizer.type", "SGD", "train.optimizer.lr", 0.0, "train.local_update_steps",
                             self.steps, "train.batch_or_epoch", "batch", "dataloader.batch_size", self.n,
                             "criterion.type", "MSELoss", "use_gpu", False])  # fmt: skip
        torch.manual_seed(1)
        # records alike, so that their clipped gradients add up: what moves all of them shows in the sum
        X, y = 1 + 0.3 * torch.randn(self.n, 3), -2 + 0.3 * torch.randn(self.n, 1)
        if canary:  # the neighbour: record 0 replaced by a far-off one
            X[0], y[0] = X[0] * 10, 50.0
        model = torch.nn.Sequential(torch.nn.Linear(3, 2), torch.nn.Linear(2, 1))
        data = {"train": DataLoader(TensorDataset(X, y), batch_size=self.n)}
        return GeneralTorchTrainer(model, data, "cpu", cfg, only_for_eval=False, monitor=Monitor(cfg)), model

    def trial_releases(self, canary: bool, trials: int, z: float | None = None, seed: int = 0):
        """(trials, steps x 8): the body's noised gradient of every step, one row a trial (``z``: this noise
        instead, 0 for the noise-free values)."""
        import torch

        from fs_fedpa.plugin.dp_sgd import DPSGD
        from fs_fedpa.privacy.mechanism import dp_generator
        from fs_fedpa.privacy.sample_level import SamplePlan

        trainer, model = self._trainer(canary)
        z = self.z if z is None else z
        start = {k: v.clone() for k, v in model.state_dict().items()}
        frozen = frozenset() if self.treatment == "noised" else HEAD
        trial = {"k": 0}
        dp = DPSGD(trainer, lambda n: SamplePlan(n, self.n, self.steps, z, 1e-5),
                   lambda routine: dp_generator(seed, f"audit {canary} trial {trial['k']}"), clip=self.C,
                   frozen=frozen)  # fmt: skip
        body = [p for name, p in model.named_parameters() if name not in HEAD]
        head = [p for name, p in model.named_parameters() if name in HEAD]
        out, row = [], []

        def record(ctx):  # after DP-SGD's step: p.grad is (clipped sum + noise) / b for the body
            row.append(torch.cat([p.grad.detach().flatten().double() for p in body]))

        def plain_head(ctx):  # the withdrawn option: the head on the exact mean-loss gradient, no clip, no noise
            inputs, target = ctx.data_batch
            grads = torch.autograd.grad(((model(inputs) - target) ** 2).mean(), head)
            with torch.no_grad():
                for p, g in zip(head, grads):
                    p.sub_(self.head_lr * g)

        trainer.register_hook_in_train(new_hook=record, trigger="on_batch_backward")
        if self.treatment == "plain":
            trainer.register_hook_in_train(new_hook=plain_head, trigger="on_batch_end", insert_pos=0)
        for k in range(trials):
            trial["k"] = k
            model.load_state_dict(start)
            dp.new_round()  # each trial is one client round of ``steps`` steps
            row.clear()
            trainer.train()
            out.append(torch.cat(row))
        return torch.stack(out)

    def bound(self, trials: int, delta: float, seed: int = 0) -> dict:
        """epsilon_lb of this treatment, with the pair's noise-free gap in units of the noise."""
        mean0, mean1 = self.trial_releases(False, 1, z=0.0)[0], self.trial_releases(True, 1, z=0.0)[0]
        gap = mean1 - mean0
        u = gap / gap.norm()
        sigma = self.z * self.C / self.n  # the per-coordinate noise of a release
        null = (self.trial_releases(False, trials, seed=seed) - mean0) @ u
        alt = (self.trial_releases(True, trials, seed=seed + 1) - mean0) @ u
        half = trials // 2
        # the threshold from the first halves (its best value over a grid), the rates from the second halves
        grid = [float(t) for t in torch_quantiles(null[:half], alt[:half])]
        threshold = max(grid, key=lambda t: epsilon_lower_bound(null[:half], alt[:half], t, delta))
        return {"treatment": self.treatment, "gap_over_noise": float(gap.norm()) / sigma,
                "epsilon_lb": epsilon_lower_bound(null[half:], alt[half:], threshold, delta)}


def torch_quantiles(null, alt, count: int = 200):
    import torch

    both = torch.cat([null, alt])
    return torch.quantile(both, torch.linspace(0.0, 1.0, count, dtype=both.dtype))


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="python -m research.tools.dp_audit", description=__doc__.splitlines()[0])
    parser.add_argument("--trials", type=cli.number(int, minimum=20), default=4000,
                        help="trials per dataset (half choose the threshold)")
    parser.add_argument("--epsilon", type=cli.number(above=0, below=50), default=1.0,
                        help="the ledger's epsilon the noise is calibrated to")
    parser.add_argument("--delta", type=cli.number(above=0, below=1), default=1e-5)
    parser.add_argument("--steps", type=cli.number(int, minimum=1, maximum=100), default=2,
                        help="DP-SGD steps (full batch)")
    parser.add_argument("--clip", type=cli.number(above=0), default=0.05)
    parser.add_argument("--treatment", choices=TREATMENTS, nargs="+", default=list(TREATMENTS))
    args = parser.parse_args(argv)
    from fs_fedpa.privacy.accountant import calibrate

    logging.getLogger("federatedscope").setLevel(logging.ERROR)  # FS's set-up warnings, four per trainer built
    n = 64
    z = calibrate(n, n, args.steps, args.epsilon, args.delta)  # the plugin's accountant: replace-one, b = n
    print(f"ledger: epsilon {args.epsilon:g} at delta {args.delta:g} (replace-one, b = n = {n}, {args.steps} steps, "
          f"z = {z:.4g}, C = {args.clip:g}); {args.trials} trials per dataset", flush=True)  # fmt: skip
    print(detection_line(args.trials, args.epsilon, args.delta), flush=True)
    for treatment in args.treatment:
        found = Audit(treatment, z, args.steps, args.clip, n).bound(args.trials, args.delta)
        verdict = "ABOVE the ledger: not private" if found["epsilon_lb"] > args.epsilon else "below the ledger"
        label = treatment + (" (withdrawn; emulated)" if treatment == "plain" else "")
        print(f"{label:24s} epsilon_lb {found['epsilon_lb']:.3f} (95 %), gap {found['gap_over_noise']:.3g} x noise: "
              f"{verdict}", flush=True)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
