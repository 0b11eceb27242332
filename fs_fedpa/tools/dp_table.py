"""Client-level DP, computed (nothing is trained): noise against signal as a function of K, the clients a round.

For a target (epsilon, delta) over T rounds at sampling rate q = K / N, the accountant gives the noise multiplier z
(:func:`fs_fedpa.privacy.accountant.calibrate`; replace-one, z / 2 to the accountant). The release adds N(0, (z C /
K)^2) to each of the D entries the method releases, a noise of norm (z C / K) sqrt(D), while the mean of K clipped
contributions has norm at most C. So signal / noise <= K / (z sqrt(D)), and K >= z sqrt(D) clients a round are
needed before the noise is even as large as the largest possible signal. D per method: FedPA-LoRA releases the
products (sum d k over modules), FedIT both factors (sum r (d + k)), FFA-LoRA and FedSVD B (sum r d), FedSA-LoRA A
(sum r k).

FedPA-LoRA's server then keeps the rank-R_g truncated SVD of each noisy product, which is post-processing and
removes most of that noise: what it can recover is a direction whose singular value exceeds the noise's spectral
norm, about (z C / K)(sqrt(d) + sqrt(k)) for Gaussian noise. With the clipped norm C spread evenly over M modules, a
module's signal is at most C / sqrt(M), so the truncated release needs K >= z sqrt(M) (sqrt(d) + sqrt(k)): the row
"fedpa, truncated" (an estimate from the noise's spectral norm, not a bound).

    python -m fs_fedpa.tools.dp_table [--epsilon 8] [--rounds 30] [--rate 0.1] [--time]
    python -m fs_fedpa.tools.dp_table --sample [--epsilon 8] [--steps 210] [--n 624 6797 13224] [--batch 16 64 256]
        [--sampling wor|poisson] [--accountant rdp|pld] [--rank R] [--layers L] [--frozen-head]

``--sample``: sample-level DP-SGD in this repository's cell instead (MiniLM-L6, r = 4 on query and value, a local
two-class head, T = 21 rounds of tau = 10 steps; by default its smallest, median and largest client). A step adds
N(0, (z C)^2) to each of the D trained entries of a sum of b per-record gradients clipped to C, so a coordinate's
signal is at most b C / sqrt(D) where its noise has standard deviation z C: the bound b / (z sqrt(D)). Adam divides
each coordinate's update by its own running scale, so that ratio is what its steps see.

``--time`` also measures FedPA-LoRA's server step for one d = k = 4096 module on this machine: the (d, k) noisy mean
of 10 rank-16 uploads, then its exact and its randomized rank-16 factors.
"""

from __future__ import annotations

import math
import sys
import time

from fs_fedpa.tools import cli

# name -> (modules as (d, k, count), LoRA rank): the attention query and value projections PEFT adapts by default
MODELS = {
    "MiniLM-L6 (this cell)": ([(384, 384, 12)], 4),
    "RoBERTa-large": ([(1024, 1024, 48)], 8),
    "Llama-3-8B": ([(4096, 4096, 32), (1024, 4096, 32)], 16),  # q_proj, v_proj (8 KV heads of 128)
}
SPACES = {  # the entries a method releases per (d, k) module at rank r
    "fedpa": lambda d, k, r: d * k,
    "fedit": lambda d, k, r: r * (d + k),
    "ffa_lora / fedsvd": lambda d, k, r: r * d,
    "fedsa_lora": lambda d, k, r: r * k,
}
K_VALUES = (10, 100, 1000, 10_000)


def released(model: str, space: str, layers: int | None = None, head: bool = False) -> int:
    """D of one client's contribution: the entries ``space`` releases of every adapted module (on the top ``layers``
    of the model's, default all), plus the two-label head when it is federated (``head``)."""
    modules, r = MODELS[model]
    share = 1.0 if layers is None else min(layers, LAYERS[model]) / LAYERS[model]
    lora = sum(round(count * share) * SPACES[space](d, k, r) for d, k, count in modules)
    return lora + (modules[0][1] * HEAD_LABELS + HEAD_LABELS if head else 0)


def table(epsilon: float, rounds: int, rate: float, layers: int | None = None, head: bool = False) -> str:
    from fs_fedpa.privacy.accountant import calibrate

    z = {}
    for K in K_VALUES:
        N = round(K / rate)
        z[K] = calibrate(N, K, rounds, epsilon, min(1e-5, 1 / (10 * N)))
    lines = [
        f"Target epsilon {epsilon:g} over T = {rounds} rounds, K of N = K / {rate:g} clients a round, delta = "
        "min(1e-5, 1/(10 N)); z from dp-accounting (replace-one). Cells: the bound on signal / noise, "
        "K / (z sqrt(D)); for 'fedpa, truncated', K / (z sqrt(M) (sqrt(d) + sqrt(k))). Released: LoRA on "
        f"{f'the top {layers}' if layers else 'all'} of each model's layers, {'with' if head else 'without'} the "
        "head.",
        "",
        "| model | method | D released | K for signal = noise | "
        + " | ".join(f"K = {K:,} (z {z[K]:.2f})" for K in K_VALUES)
        + " |",
        "|---|---|---|---|" + "---|" * len(K_VALUES),
    ]
    for model in MODELS:
        for space in SPACES:
            D = released(model, space, layers, head)
            need = z[K_VALUES[-1]] * math.sqrt(D)
            cells = " | ".join(f"{K / (z[K] * math.sqrt(D)):.3g}" for K in K_VALUES)
            lines.append(f"| {model} | {space} | {D:,} | {need:,.0f} | {cells} |")
            if space == "fedpa":
                modules, _ = MODELS[model]
                share = 1.0 if layers is None else min(layers, LAYERS[model]) / LAYERS[model]
                M = sum(round(count * share) for _, _, count in modules)
                spread = math.sqrt(M) * max(math.sqrt(d) + math.sqrt(k) for d, k, _ in modules)
                cells = " | ".join(f"{K / (z[K] * spread):.3g}" for K in K_VALUES)
                lines.append(
                    f"| {model} | fedpa, truncated | (rank R_g) | {z[K_VALUES[-1]] * spread:,.0f} | {cells} |"
                )
    return "\n".join(lines)


HEAD_LABELS = 2
LAYERS = {"MiniLM-L6 (this cell)": 6, "RoBERTa-large": 24, "Llama-3-8B": 32}  # each adapts 2 modules a layer
TRAINED = {  # entries DP-SGD trains per (d, k) module at rank r: both factors, or B alone (A fixed)
    "fedpa / fedit / fedsa_lora": lambda d, k, r: r * (d + k),
    "ffa_lora / fedsvd": lambda d, k, r: r * d,
}


def trained(space: str, model: str = "MiniLM-L6 (this cell)", rank: int | None = None, layers: int | None = None,
            head: bool = True) -> int:  # fmt: skip
    """D: the LoRA entries DP-SGD trains (at ``rank``, default the model's; on the top ``layers`` of the model's,
    default all: ``model.seqcls.layers_to_transform``) plus the classifier head (hidden size k, two labels) unless
    ``head`` is False (``fedpa.dp.local_tensors frozen``: the local head takes no step, so it is not in D)."""
    modules, r = MODELS[model]
    r = rank or r
    total_layers = LAYERS[model]
    share = 1.0 if layers is None else min(layers, total_layers) / total_layers
    lora = sum(round(count * share) * TRAINED[space](d, k, r) for d, k, count in modules)
    return lora + (modules[0][1] * HEAD_LABELS + HEAD_LABELS if head else 0)


def sample_table(epsilon: float, steps: int, ns: list[int], batches: list[int], sampling: str = "wor",
                 accounting: str = "rdp", rank: int | None = None, layers: int | None = None,
                 head: bool = True) -> str:  # fmt: skip
    """The sample-level table; ``sampling``, ``accounting``, ``rank``, ``layers`` and ``head`` are the regime's knobs
    (``fedpa.dp.sampling``, ``fedpa.dp.accountant``, ``model.seqcls.r``, ``model.seqcls.layers_to_transform`` on the
    top layers, ``fedpa.dp.local_tensors``)."""
    from fs_fedpa.privacy.accountant import ADJACENCY, calibrate
    from fs_fedpa.privacy.settings import dp_delta_for

    D = {space: trained(space, rank=rank, layers=layers, head=head) for space in TRAINED}
    how = "without replacement" if sampling == "wor" else "Poisson, b expected"
    lines = [
        f"Sample level: epsilon {epsilon:g} over {steps} steps of b of a client's n records ({how}; "
        f"{ADJACENCY[sampling]}; {accounting}), delta = min(1e-5, 1/(10 n)); z from dp-accounting; trained: "
        f"LoRA r = {rank or MODELS['MiniLM-L6 (this cell)'][1]} on {layers or 'all'} of MiniLM's 6 layers, "
        f"{'with' if head else 'without'} the head. Cells: z, and the bound on a coordinate's signal / noise, "
        "b / (z sqrt(D)).",
        "",
        "| n | b | z | " + " | ".join(f"{space} (D = {D[space]:,})" for space in TRAINED) + " |",
        "|---|---|---|" + "---|" * len(TRAINED),
    ]
    for n in ns:
        for b in batches:
            z = calibrate(n, min(b, n), steps, epsilon, dp_delta_for(0.0, n, "n_i records"), sampling, accounting)
            cells = " | ".join(f"{b / (z * math.sqrt(D[space])):.3g}" for space in TRAINED)
            lines.append(f"| {n:,} | {b} | {z:.3g} | {cells} |")
    lines += ["", "The bound holds only where every record's gradient is at least C long and all agree: a record "
              "inside C gives less than C while the noise grows with C. MiniLM's LoRA gradients are shorter than "
              "0.1 (docs/privacy.md), so at C = 1, n = 8,000, b = 256 and Poisson's z = 0.62 the measured noise was "
              "55 times the signal where this bound promised a signal 3.7 times the noise. Measure the real ratio "
              "before a run with research/scripts/dp_signal_noise.py, or read it in each client's log (noise/signal)."]
    return "\n".join(lines)


def time_module(d: int = 4096, clients: int = 10, r: int = 16) -> str:
    import torch

    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.privacy.post_processing import top_factors
    from fs_fedpa.privacy.mechanism import dp_generator, release_products

    g = torch.Generator().manual_seed(0)
    uploads = [{"m": (torch.randn(d, r, generator=g) * 1e-2, torch.randn(r, d, generator=g) / d**0.5)}
               for _ in range(clients)]  # fmt: skip
    start = time.perf_counter()
    release, _ = release_products(uploads, {"m": (d, d)}, clients, 1.0, 1.0, dp_generator(0))
    t_release = time.perf_counter() - start
    out = [f"one {d} x {d} module, {clients} rank-{r} uploads, {torch.get_num_threads()} threads: noisy mean "
           f"{t_release:.2f} s ({release['m'].numel() * 8 / 2**20:.0f} MiB in float64 while formed)"]  # fmt: skip
    for svd in ("randomized", "reduced"):
        start = time.perf_counter()
        top_factors(release["m"], r, FedPAConfig(svd=svd), dp_generator(0))
        out.append(f"rank-{r} factors, fedpa.svd {svd}: {time.perf_counter() - start:.2f} s")
    return "; ".join(out)


def main(argv: list[str] | None = None) -> int:
    parser = cli.Parser(prog="python -m fs_fedpa.tools.dp_table", description=__doc__.splitlines()[0])
    count = cli.number(int, minimum=1)
    parser.add_argument("--epsilon", type=cli.number(above=0), default=8.0)
    parser.add_argument("--rounds", type=count, default=30)
    parser.add_argument("--rate", type=cli.number(above=0, maximum=1), default=0.1)
    parser.add_argument("--time", action="store_true", help="also time FedPA-LoRA's DP server step at d = 4096")
    parser.add_argument("--sample", action="store_true", help="sample-level DP-SGD in this cell instead")
    parser.add_argument("--steps", type=count, default=210, help="--sample: DP-SGD steps over the run (T tau)")
    parser.add_argument("--tau", type=count, default=None,
                        help="--sample: local steps a round; the steps are then --rounds x tau, not --steps")
    parser.add_argument("--n", type=count, nargs="+", default=[624, 6797, 13224], help="--sample: clients' records")
    parser.add_argument("--batch", type=count, nargs="+", default=[16, 64, 256], help="--sample: records a step")
    parser.add_argument("--sampling", choices=("wor", "poisson"), default="wor", help="--sample: fedpa.dp.sampling")
    parser.add_argument("--accountant", choices=("rdp", "pld"), default="rdp", help="--sample: fedpa.dp.accountant")
    parser.add_argument("--rank", type=count, default=None, help="--sample: the LoRA rank (default 4)")
    parser.add_argument("--layers", type=count, default=None, help="LoRA on the top LAYERS layers only")
    parser.add_argument("--frozen-head", action="store_true",
                        help="--sample: the local head is held at its initial value (dp_local_tensors frozen): not in D")
    parser.add_argument("--federated-head", action="store_true",
                        help="client level: the head is federated, so every contribution releases it too")
    args = parser.parse_args(argv)
    if args.tau is not None and (not args.sample or args.tau < 1):
        parser.error("--tau needs --sample and a value >= 1")
    if args.sample:
        steps = args.rounds * args.tau if args.tau else args.steps
        from fs_fedpa.privacy.accountant import PLD_MAX_EVENTS

        if args.accountant == "pld" and steps > PLD_MAX_EVENTS:
            parser.error(f"--accountant pld composes at most {PLD_MAX_EVENTS:,} steps (here {steps:,}): beyond it "
                         "each cell takes minutes and more; use --accountant rdp")  # fmt: skip
        print(sample_table(args.epsilon, steps, args.n, args.batch, args.sampling, args.accountant, args.rank,
                           args.layers, not args.frozen_head))  # fmt: skip
        return 0
    print(table(args.epsilon, args.rounds, args.rate, args.layers, args.federated_head))
    if args.time:
        print()
        print(time_module())
    return 0


if __name__ == "__main__":
    sys.exit(cli.one_line_errors(main, "dp_table")())
