"""The ``dpregime`` stage of the SST-2 protocol (issue 59): a regime in which sample-level DP-SGD at ε = 8 learns,
and which federated LoRA method to use there. Declared on 2026-11-28, before any of its runs; nothing here is read
from the dev set. No torch, no FS.

Fixed for every run (the protocol's federation, ``yaml_configs/compare_sst2_protocol.yaml``: 10 clients, LDA 0.5,
r = 4, alpha = 8):

- DP-SGD at ε = :data:`EPSILON` calibrated in the DP fine-tuning papers' convention: Poisson sampling at rate b/n_i,
  add/remove adjacency, the PLD accountant (``fedpa.dp_sampling poisson``, ``fedpa.dp_accountant pld``), δ =
  min(1e-5, 1/(10 n_i)), clip C = :data:`CLIP` (the central anchor's; not tuned). The ledgers give the same noise
  read as replace-one, its Poisson sampling kept; the ``*_replace`` cells calibrate to ε = 8 with
  fixed-size sampling and replace-one.
- :data:`STEPS` noisy steps a client over the run (τ·R = 120, R rounds of τ local steps), the horizon of the noise
  calibration; the learning rate warms up linearly over the first :data:`WARMUP` of them, then stays constant
  (``fedpa.lr_schedule``), the same for every client.
- Clients under :data:`MIN_RECORDS` sentences take no DP step (``fedpa.dp_min_records``: ε 0, weight 0; three of
  the ten, 634-956 sentences, whose z at b = 256 would be near 3). They still evaluate. Without DP they train.
- The held-out split (``data.glue_holdout``) scores the search; the dev set only the finals. Evaluation every R/4
  rounds; the search's score is :func:`research.study.sst2_protocol.score` (the mean of the last two).

The search (FedIT, seed 0, at the final runs' noise):

A. b ∈ :data:`BATCHES` × τ ∈ :data:`TAUS` × head ∈ :data:`HEADS` (``local``: the client's own head, trained plainly,
   neither clipped nor noised, ``fedpa.dp_local_tensors plain``; ``federated``: clipped and noised with the LoRA
   factors and averaged by the server), LoRA on the top two layers with the prefix cache, AdamW 5e-4: 8 runs.
B. At A's best (b, τ, head): every optimizer of :data:`OPTIMIZERS` (AdamW 2e-4, 5e-4, 1e-3; SGD with momentum 0.9 at
   2e-2) × trainable set of :data:`LAYERS` (the top two layers, the top one): 7 more runs.

C. Amended on 2026-11-28, after A and B's first three runs, before any run of C (docs/study/sst2_protocol.md): at the
   best of A and B, every clip C of :data:`CLIPS` × b ∈ :data:`BATCHES`: 4 runs. Every A and B run ends at the clients'
   shard-majority score, and ``research/scripts/dp_signal_noise.py`` (one client of the training split, n = 8,000,
   b = 256, z = 0.62) measured why: with the head local, a record's LoRA gradient is shorter than 0.1, far inside C = 1
   (a step's clipped sum is the same at C = 0.1), so that sum is about 1.2 while the noise, z·C·√D, is about 68, 55
   times it, whatever the optimizer; 5 times it at C = 0.1, 2.5 times at C = 0.01, where every record is clipped (and
   C = 0.001 is the same run under Adam, every gradient scaled by C). B's other four runs (the top layer alone, at
   C = 1) are dropped for that reason. With the head federated its gradient is longer than 1, so every record is
   clipped at any C ≤ 1: noise/signal 2.1 at C = 1, 0.1 and 0.01 alike, and under Adam the same run; C does not vary
   it. b = 1,024 is tried again at the new clips: four times the signal against 1.4-2.5 times the noise (its larger z).

D. Amended on 2026-11-28, after C's first run (C = 0.01, b = 256: the majority score again, the held-out loss of
   the C = 1 run, though its clients logged noise at 0.4-1.4 times the clipped sum), before any run of D. Diagnostics,
   not selecting: can this regime learn beyond the label prior at all, and which of DP-SGD's parts stops it? At the
   best of A and B, FedIT on the held-out split without DP (every client trains), and with DP-SGD's sampling and
   clip but noise z = :data:`DIAG_Z` (1/50-1/90 of the finals'; its ε is meaningless) at C = 1 (the clip never
   binds: DP-SGD's own path, noise aside) and at C = 0.01 (every record clipped): 3 runs.

F. Amended on 2026-11-28, after D's run without DP had reached round 60 of 120 still at the shard-majority score
   (held-out 0.7545 at round 30 and about 0.75 at round 60, macro-F1 0.43; its clients' training batches still
   predicted their majority label), before any run of F. AdamW 5e-4, the rate of Li et al.'s full fine-tuning, is
   too slow for a fresh head and LoRA in 120 steps even without noise; the main cell selected 2e-3 to 5e-3 for every
   method. So: at the best of A and B with C = 0.1 (of C's clips, the one whose clients logged the lowest noise
   against the clipped sum, 0.3-1.3), AdamW at every rate of :data:`F_LRS` under DP (selecting), and FedIT without
   DP at 5e-3 (a diagnostic, not selecting): 3 runs. A larger rate moves every coordinate further under Adam whatever
   its noise, so it can also make things worse; the held-out score decides.

G. Amended on 2026-11-29, after C's two runs at b = 256, D's first two and F's two selecting runs, before C's two
   runs at b = 1,024, D's run at C = 0.01 and F's diagnostic: those three runs are dropped, unrun (about 6 CPU-h
   here; the issue sized the whole stage to about 30 and its finals alone price at 35). C's runs at b = 1,024 keep
   AdamW 5e-4, the rate at which D's run without any noise stayed at the majority score for 90 of its 120 steps;
   under Adam a step's size is set by the rate, not by b, so four times the records do not make it start sooner.
   D's question (which part of DP-SGD stops learning) was answered by F: the rate. F's diagnostic is the finals'
   FedIT without DP in the same regime, which runs on the dev set over three seeds. Should a b = 1,024 run have
   scored higher, the selection would differ: the regime is the best of the runs made, and the report says so.

The regime is the search run with the best held-out score among A, B, C and F as run (strictly; the first in the
order above among ties).

H. Amended on 2026-11-29, before any final: the finals forward a batch on the CPU in length-sorted chunks of
   :data:`CHUNK` records, without DP ``model.seqcls.train_chunk`` (the batch's mean-loss gradient summed over the
   chunks) and under DP ``fedpa.dp_chunk`` (each record clipped alone, as in chunks of 4): the same steps (tests
   against autograd on the whole batch), measured side by side at 0.33 and 0.75 of the step time
   (``research/benchmarks/bench_dp_sgd.py --batch 256 --layers 2 --tok-len 48``). An accelerator takes the whole batch.

The finals, in that regime, on the dev set, seeds 0-2 (seed-major): FedPA-LoRA (the main cell's λ), FedIT, FFA-LoRA
and FedSVD with DP and without; FedIT with DP calibrated to ε = 8 under fixed-size sampling and replace-one
(``fedit_dp_replace``); and the central anchors, one seed: one client with every training sentence, with DP in
both conventions and without. Endpoint: dev accuracy (``val_acc``) at the last round. Comparisons: FedPA-LoRA
against each other method under DP (Holm over 3), and each method under DP against itself without (Holm over 4);
paired over seeds, t intervals.

I. Amended on 2026-11-29, after seed 0 of the finals and before seeds 1-2 (seed 0 under DP: FedPA-LoRA 0.667, FedIT
   0.837, FFA-LoRA 0.813, FedSVD 0.817): a third family, so that the report can say which method to use under DP
   and not only whether FedPA-LoRA is behind: FedIT, FFA-LoRA and FedSVD pairwise under DP (Holm over 3). It was
   added after seeing a seed, and the report says so.

E. The cross-device client-level demonstration (issue 59 §3), declared on 2026-11-28 before its runs, in
   :mod:`research.study.sst2_dp_device`; it does not depend on the search.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from research.study import sst2_dp_device
from research.study import sst2_protocol as sp

STAGE = "dpregime"
EPSILON, CLIP, MIN_RECORDS = 8.0, 1.0, 1000  # CLIP: parts A and B's
CLIPS = (0.1, 0.01)  # part C's (the amendment above)
STEPS, WARMUP, EVALS = 120, 12, 4
BATCHES, TAUS, HEADS = (256, 1024), (1, 2), ("local", "federated")
LAYERS = ((4, 5), (5,))  # MiniLM's top two layers, its top one
B_LAYERS = LAYERS[:1]  # part B as run: its top-one-layer half was dropped by the amendment
C_BATCHES = BATCHES[:1]  # part C as run: b = 1,024 dropped by amendment G
FIRST = ("AdamW", 5e-4)  # part A's optimizer
OPTIMIZERS = (("AdamW", 2e-4), ("AdamW", 5e-4), ("AdamW", 1e-3), ("SGD", 2e-2))
MOMENTUM = 0.9  # SGD's
METHODS = ("fedpa", "fedit", "ffa_lora", "fedsvd")
OTHERS = METHODS[1:]  # amendment I's pairwise family
REFERENCE = "fedit"  # the search's method
SEEDS, CENTRAL_SEED = (0, 1, 2), 0
DIAG_Z, DIAG_CLIPS = 0.01, (CLIP, 0.01)  # part D's noise multiplier and clips as declared
D_CLIPS = DIAG_CLIPS[:1]  # part D as run: C = 0.01 dropped by amendment G
F_LRS, F_CLIP = (5e-3, 2e-3), 0.1  # part F's rates (AdamW, as at the best of A and B) and clip
CHUNK = 32  # records a CPU forward takes in the finals (amendment H)


@dataclass(frozen=True)
class Regime:
    """One point of the search: b records a step, τ steps a round, the head's place, the adapted layers, the
    optimizer and its rate, and the clip C."""

    b: int
    tau: int
    head: str
    layers: tuple[int, ...]
    optimizer: str
    lr: float
    clip: float = CLIP

    @property
    def rounds(self) -> int:
        return STEPS // self.tau

    @property
    def name(self) -> str:
        layers = "".join(map(str, self.layers))
        clip = "" if self.clip == CLIP else f"_c{self.clip:g}"  # parts A and B's names as they were run
        return f"b{self.b}_tau{self.tau}_{self.head}_l{layers}_{self.optimizer.lower()}{self.lr:g}{clip}"

    def opts(self) -> tuple[str, ...]:
        """The FS overrides of this regime, without DP."""
        opts = ("dataloader.batch_size", str(self.b), "train.local_update_steps", str(self.tau),
                "eval.freq", str(self.rounds // EVALS),
                "model.seqcls.layers_to_transform", str(list(self.layers)), "model.seqcls.prefix_cache", "True",
                "personalization.local_param", "['classifier']" if self.head == "local" else "[]",
                "train.optimizer.type", self.optimizer, "train.optimizer.lr", f"{self.lr:g}",
                "fedpa.lr_schedule", "constant", "fedpa.lr_warmup_steps", str(WARMUP))  # fmt: skip
        if self.optimizer == "SGD":
            opts += ("train.optimizer.momentum", f"{MOMENTUM:g}")
        return (*opts, *sp.ONE_THREAD)

    def dp_opts(self, convention: str = "add_remove", z: float | None = None) -> tuple[str, ...]:
        """DP-SGD at ε = 8 over the run: ``add_remove`` (Poisson, the papers') or ``replace`` (fixed-size sampling,
        replace-one); both with the PLD accountant. ``z``: this noise multiplier instead of ε's (part D's, read by the
        RDP accountant, which takes any z)."""
        sampling = {"add_remove": "poisson", "replace": "wor"}[convention]
        noise = ("fedpa.dp_epsilon", f"{EPSILON:g}") if z is None else ("fedpa.dp_noise_multiplier", f"{z:g}")
        opts = ("fedpa.dp_mode", "sample", *noise, "fedpa.dp_clip", f"{self.clip:g}", "fedpa.dp_sampling", sampling,
                "fedpa.dp_accountant", "pld" if z is None else "rdp", "fedpa.dp_horizon", str(self.rounds),
                "fedpa.dp_min_records", str(MIN_RECORDS))  # fmt: skip
        if self.head == "local":
            opts += ("fedpa.dp_local_tensors", "plain")
        return opts

    @classmethod
    def of(cls, name: str) -> Regime:
        """The regime a search run's name states (the inverse of :attr:`name`)."""
        b, tau, head, layers, opt, *rest = name.split("_")
        optimizer = "AdamW" if opt.startswith("adamw") else "SGD"
        clip = float(rest[0][1:]) if rest and rest[0].startswith("c") else CLIP
        return cls(int(b[1:]), int(tau[3:]), head, tuple(int(c) for c in layers[1:]), optimizer,
                   float(opt[len(optimizer):]), clip)  # fmt: skip


def _search_run(regime: Regime) -> sp.Run:
    opts = (*regime.opts(), *regime.dp_opts(), *sp.TUNE_EVAL)
    return sp.Run(STAGE, f"search_{regime.name}", REFERENCE, opts, 0, regime.rounds)


def search_a() -> list[sp.Run]:
    """Part A: b × τ × head at the top two layers and AdamW 5e-4."""
    return [_search_run(Regime(b, tau, head, LAYERS[0], *FIRST)) for b in BATCHES for tau in TAUS for head in HEADS]


def search_b(best_a: Regime) -> list[sp.Run]:
    """Part B: every optimizer × trainable set (:data:`B_LAYERS`) at A's best (b, τ, head), less the run A already
    made."""
    runs = []
    for layers in B_LAYERS:
        for optimizer, lr in OPTIMIZERS:
            regime = Regime(best_a.b, best_a.tau, best_a.head, layers, optimizer, lr)
            if regime != best_a:
                runs.append(_search_run(regime))
    return runs


def search_c(best_ab: Regime) -> list[sp.Run]:
    """Part C: every clip of :data:`CLIPS` × b of :data:`C_BATCHES` at the best of A and B."""
    return [_search_run(replace(best_ab, b=b, clip=clip)) for clip in CLIPS for b in C_BATCHES]


def _nodp_run(regime: Regime) -> sp.Run:
    """FedIT in ``regime`` without DP, on the held-out split: a diagnostic, named ``diag_<regime at C = 1>_nodp``."""
    plain = replace(regime, clip=CLIP)
    return sp.Run(STAGE, f"diag_{plain.name}_nodp", REFERENCE, (*plain.opts(), *sp.TUNE_EVAL), 0, plain.rounds)


def diagnostics(best_ab: Regime) -> list[sp.Run]:
    """Part D, not selecting: at the best of A and B, FedIT without DP, then with noise z = :data:`DIAG_Z` at each
    clip of :data:`D_CLIPS`; the held-out split."""
    runs = [_nodp_run(best_ab)]
    for clip in D_CLIPS:
        regime = replace(best_ab, clip=clip)
        opts = (*regime.opts(), *regime.dp_opts(z=DIAG_Z), *sp.TUNE_EVAL)
        runs.append(sp.Run(STAGE, f"diag_{regime.name}_z{DIAG_Z:g}", REFERENCE, opts, 0, regime.rounds))
    return runs


def best(results: dict, runs: list[sp.Run]) -> sp.Run | None:
    """The run of ``runs`` with the best held-out score (strictly; the first among ties), once all are in."""
    if not runs or any(r.key not in results for r in runs):
        return None
    top = None
    for run in runs:
        value = sp.score(results[run.key])
        if value is not None and (top is None or value > top[0]):
            top = (value, run)
    return top[1] if top else None


def regime_of(run: sp.Run) -> Regime:
    return Regime.of(run.name[len("search_") :])


def chunk_opts(dp: bool) -> tuple[str, ...]:
    """Amendment H: a CPU forward of :data:`CHUNK` length-sorted records, DP-SGD's or the plain step's."""
    return ("fedpa.dp_chunk" if dp else "model.seqcls.train_chunk", str(CHUNK))


def final_runs(regime: Regime, fedpa_lam: float) -> list[sp.Run]:
    """The finals in ``regime`` (seed-major) and the central anchors."""
    base = (*regime.opts(), *sp.FINAL_EVAL)
    plain, private = chunk_opts(False), (*regime.dp_opts(), *chunk_opts(True))
    replace_one = (*regime.dp_opts("replace"), *chunk_opts(True))
    runs = []
    for seed in SEEDS:
        for method in METHODS:
            lam = ("fedpa.lam", f"{fedpa_lam:g}") if method == "fedpa" else ()
            runs.append(sp.Run(STAGE, method, method, (*base, *lam, *plain), seed, regime.rounds))
            runs.append(sp.Run(STAGE, f"{method}_dp", method, (*base, *lam, *private), seed, regime.rounds))
        runs.append(sp.Run(STAGE, "fedit_dp_replace", "fedit", (*base, *replace_one), seed, regime.rounds))
    one = ("federate.client_num", "1", "federate.sample_client_num", "1")
    for cell, extra in (("central", plain), ("central_dp", private), ("central_dp_replace", replace_one)):
        runs.append(sp.Run(STAGE, cell, "fedit", (*base, *one, *extra), CENTRAL_SEED, regime.rounds))
    return runs


def search_f(best_ab: Regime) -> list[sp.Run]:
    """Part F (selecting): at the best of A and B with C = :data:`F_CLIP`, every rate of :data:`F_LRS` under DP."""
    return [_search_run(replace(best_ab, lr=lr, clip=F_CLIP)) for lr in F_LRS]



@dataclass(frozen=True)
class Search:
    """The search's parts as far as the committed results determine them (None: not planned yet), and the
    selected search run (None before every selecting run is in)."""

    a: list[sp.Run]
    b: list[sp.Run] | None = None
    c: list[sp.Run] | None = None
    d: list[sp.Run] | None = None
    f: list[sp.Run] | None = None
    top: sp.Run | None = None


def search(results: dict) -> Search:
    """Part A's runs; B's once A has selected; C's, D's and F's once A and B have; the regime once A, B, C and F's
    selecting runs are all in (the best of them, the first among ties in that order)."""
    a = search_a()
    top_a = best(results, a)
    if top_a is None:
        return Search(a)
    b = search_b(regime_of(top_a))
    top_ab = best(results, [top_a, *b])
    if top_ab is None:
        return Search(a, b)
    regime = regime_of(top_ab)
    c, f = search_c(regime), search_f(regime)
    return Search(a, b, c, diagnostics(regime), f, best(results, [top_ab, *c, *f]))


def runs(selected: dict, results: dict) -> list[tuple[str, list[sp.Run]]]:
    """The stage's parts, as far as the committed results determine them."""
    found = search(results)
    parts = [("dp regime: search A (b, tau, head)", found.a)]
    if found.b is not None:
        parts.append(("dp regime: search B (optimizer, layers)", found.b))
    if found.c is not None:
        parts.append(("dp regime: search C (clip, b)", found.c))
        parts.append(("dp regime: diagnostics D (not selecting)", found.d))
        parts.append(("dp regime: search F (learning rate)", found.f))
    if found.top is not None:
        parts.append(("dp regime: finals", final_runs(regime_of(found.top), selected["methods"]["fedpa"]["lam"])))
    plain, private = sst2_dp_device.runs(selected, results)
    parts += [("dp regime: cross-device, no DP", plain), ("dp regime: cross-device, DP", private)]
    return parts


def selected_regime(results: dict) -> Regime | None:
    """The regime the search selected, or None before it has."""
    top = search(results).top
    return regime_of(top) if top else None


# ------------------------------------------------------------------------------------------------ CPU cost
# Measured on this CPU host (2 cores), one thread, nothing else running (2026-11-28):
#   python research/benchmarks/bench_dp_sgd.py --data ../shared/data/glue --batch 256 --layers 2 --tok-len 48 \
#       --kinds cache plain_cache --local-steps 2 --routines 3
# seconds per record of a step with LoRA on the top two layers and the prefix cache: DP-SGD 10.2 ms (its taps take
# length-sorted chunks of 4 records), plain 16.9 ms (one batch padded to its longest record); a record's first pass
# through the frozen prefix (the cache's fill) about 14 ms. Assumed, not measured: the top layer alone costs half a
# step of the top two, an evaluated record half a training record.
SECONDS_PER_RECORD = {"plain": 0.0169, "dp": 0.0102, "prefix": 0.014}
# Amendment H's chunks of 32, from the ratios measured side by side on 2026-11-29 (the same command with
# --kinds plain_cache plain_chunks, then cache cache_chunks; beside two other runs, so the ratios, not the times):
# 0.33 of the plain step, 0.75 of DP-SGD's in chunks of 4.
SECONDS_PER_RECORD |= {"plain_chunks": 0.33 * SECONDS_PER_RECORD["plain"], "dp_chunks": 0.75 * SECONDS_PER_RECORD["dp"]}
# The committed split's client sizes (every stage's ledgers): the three under MIN_RECORDS take no DP step.
CLIENT_SIZES = (6424, 13425, 634, 3598, 956, 12696, 13379, 7377, 646, 8214)
EVAL_RECORDS = {"0": 872, "holdout": round(sum(CLIENT_SIZES) * sp.HOLDOUT)}  # the dev set, the held-out split


def cpu_seconds(run: sp.Run) -> float:
    """The CPU seconds a run of this stage takes here, from :data:`SECONDS_PER_RECORD`: the cache's fill, every
    client's steps of min(b, n_i) records (under DP the small clients take none), and the evaluations."""
    if run.name.startswith("device_"):
        return sst2_dp_device.cpu_seconds(run)
    o = dict(zip(run.opts[::2], run.opts[1::2]))
    b, tau = int(o["dataloader.batch_size"]), int(o["train.local_update_steps"])
    dp = sp.dp_sgd(run.opts)
    sizes = (sum(CLIENT_SIZES),) if o.get("federate.client_num") == "1" else CLIENT_SIZES
    records = sum(min(b, n) for n in sizes if not (dp and n < MIN_RECORDS)) * tau * run.rounds
    top_one = o["model.seqcls.layers_to_transform"].count(",") == 0
    chunked = "fedpa.dp_chunk" in o or "model.seqcls.train_chunk" in o
    step = SECONDS_PER_RECORD[("dp" if dp else "plain") + ("_chunks" if chunked else "")] * (0.5 if top_one else 1.0)
    evaluated = EVAL_RECORDS.get(o.get("data.glue_holdout", "0"), EVAL_RECORDS["holdout"]) * EVALS
    evaluated *= 2 if o.get("fedpa.eval_local") == "True" else 1  # the global model and each client's own
    return sum(CLIENT_SIZES) * SECONDS_PER_RECORD["prefix"] + records * step + evaluated * 0.5 * step


def minutes(runs: list[sp.Run], results: dict) -> float:
    """The CPU minutes the runs of ``runs`` without a result will take here."""
    return sum(cpu_seconds(r) for r in runs if r.key not in results) / 60


def stage_hours() -> tuple[float, float]:
    """The whole stage's CPU hours here before any run, as a range over the selections the search can make: part A,
    parts B, C, D and F at A's cheapest and dearest (b, τ, head), the finals in the cheapest and dearest regime, and
    part E."""
    a = search_a()
    regimes = [Regime(b, t, h, layers, o, lr) for b in BATCHES for t in TAUS for h in HEADS for layers in LAYERS
               for o, lr in OPTIMIZERS]  # fmt: skip
    bc_costs = [minutes([*search_b(r), *search_c(r), *diagnostics(r), *search_f(r)], {})
                for r in map(regime_of, a)]  # fmt: skip
    finals = [minutes(final_runs(r, 0.1), {}) for r in regimes]
    base = minutes(a, {}) + sst2_dp_device.part_seconds() / 60
    return (base + min(bc_costs) + min(finals)) / 60, (base + max(bc_costs) + max(finals)) / 60
