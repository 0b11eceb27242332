"""Issue 59 §3, client-level DP where it can work: one cross-device demonstration, part of the ``dpregime`` stage.
Declared on 2026-11-28, before any of its runs; nothing here is read from the dev set. No torch, no FS.

At K = 10 clients a round the noise of client-level DP is 26-37 times the largest possible signal whatever the
tuning (the privacy stage); the bound K/(z√D) reaches 1 near K = 400 for the reduced trainable set. So:

- N = :data:`CLIENTS` clients of SST-2's training split, LDA with α = :data:`ALPHA` (at α = 0.5 about 33 of 2,000
  Dirichlet shares are empty, measured over 20 draws, and FS's splitter redraws until none is, without end; at
  α = 1 about 1.4 are, so it redraws a few times), K = :data:`SAMPLED` drawn a round by FS's sampler, T =
  :data:`ROUNDS` rounds; the dev set follows each client's label distribution as in every stage (most clients hold
  0-1 dev sentences; the reported accuracy is FS's weighted mean over all of them, the whole dev set).
- Each client takes τ = :data:`LOCAL_STEPS` step of b = 16 sentences a round (its shard averages 34), LoRA r = 4 on
  MiniLM's top two layers with the prefix cache, the head federated (released, so clipped and noised with the
  factors). Each method of :data:`METHODS` at the optimizer and rate selected in the main cell (FedSVD at
  FFA-LoRA's; FedPA-LoRA at its λ), seed :data:`SEED`.
- First without DP, then with client-level DP at ε = :data:`EPSILON` over T rounds (``fedpa.dp_mode client``: K of N
  sampled, replace-one adjacency, δ = min(1e-5, 1/(10 N)) = 1e-5) and C = the median over rounds of the round's mean
  contribution norm in the method's own no-DP run (the privacy stage's rule (b), chosen outside ε).
- Endpoint: dev accuracy of the global model at the last round, DP against no DP per method. One seed: a
  measurement, not a test; no ranking is claimed from it.

Amended on 2026-11-29, after the four runs without DP and before any with DP (issue 59's budget): a method's DP
run is made only if its run without DP learned, ending above the dev set's one-label accuracy (:data:`ONE_LABEL`,
444 of 872 sentences) by more than two binomial standard errors of an accuracy near 1/2 on 872 sentences
(:data:`LEARNED`). Without DP FedIT ended at 0.779; FedPA-LoRA (0.509), FFA-LoRA (0.509) and FedSVD (0.511) stayed
at one label, so the noise of a DP run would be measured against a model that had not moved off the label prior, and
their three DP runs (about 110 CPU-min here) are dropped unrun.
"""

from __future__ import annotations

from research.study import protocol_results as pr
from research.study import sst2_privacy as spriv
from research.study import sst2_protocol as sp

STAGE = "dpregime"
CLIENTS, SAMPLED, ROUNDS, ALPHA, LOCAL_STEPS, EVERY, SEED = 2000, 400, 30, 1.0, 1, 10, 0
EPSILON = 8.0
METHODS = ("fedpa", "fedit", "ffa_lora", "fedsvd")
LAYERS = (4, 5)
ONE_LABEL = 444 / 872  # SST-2's dev set: its larger class
LEARNED = ONE_LABEL + 2 * (0.25 / 872) ** 0.5  # the amendment's bar for a DP run, about 0.543


def base_opts() -> tuple[str, ...]:
    """The federation and the trainable set of every run of this part (no DP, no method)."""
    return ("federate.client_num", str(CLIENTS), "federate.sample_client_num", str(SAMPLED),
            "data.splitter_args", f"[{{'alpha': {ALPHA:g}}}]", "train.local_update_steps", str(LOCAL_STEPS),
            "model.seqcls.layers_to_transform", str(list(LAYERS)), "model.seqcls.prefix_cache", "True",
            "personalization.local_param", "[]", "eval.freq", str(EVERY),
            "data.glue_holdout", "0", "fedpa.eval_local", "False", *sp.ONE_THREAD)  # fmt: skip


def learned(result: dict | None) -> bool:
    """Whether a run without DP ended above :data:`LEARNED` on the dev set (the amendment's bar for its DP run)."""
    accuracy = pr.final_metric(result, "val_acc") if result else None
    return accuracy is not None and accuracy > LEARNED


def plain_run(selected: dict, method: str) -> sp.Run:
    """A method's run of this part without DP."""
    opts = (*spriv.client_dp_method_opts(selected, method), *base_opts())
    return sp.Run(STAGE, f"device_{method}", method, opts, SEED, ROUNDS)


def runs(selected: dict, results: dict) -> tuple[list[sp.Run], list[sp.Run]]:
    """The no-DP runs, and the DP runs of the methods whose no-DP run is in and learned (their clip comes from it)."""
    plain, private = [], []
    for method in METHODS:
        base = plain_run(selected, method)
        plain.append(base)
        clip = spriv.median_contribution(results.get(base.key), method)
        if clip is not None and learned(results.get(base.key)):
            private.append(sp.Run(STAGE, f"device_{method}_dp", method, (*base.opts, *spriv.client_dp(clip, EPSILON)),
                                  SEED, ROUNDS))  # fmt: skip
    return plain, private


# Measured on this CPU host, one thread (2026-11-28): a two-round run of this part's fedit cell (N = 2,000, K = 400)
# took 433 CPU seconds (667 s wall beside two other runs on the 2 cores; its log's timestamps split the wall time
# 332 s for FS to set up 2,000 clients, 135 and about 150 s for the two rounds, 7 s for the evaluation by every client).
# Scaled by CPU/wall: a client's set-up 0.11 s, a drawn client's turn (its step of 16 records, their first pass through
# the frozen prefix, messages, factors in and out) 0.22 s, an evaluation by all N clients 5 s. Since then
# fs_patches.sized_once sizes the shared model once instead of pickling it for every client: FS's set-up of 300 of
# these clients under cProfile went from 56 s to 6.7 s, so a client's set-up is priced at 0.02 s.
SETUP_SECONDS, TURN_SECONDS, EVAL_SECONDS = 0.02, 0.22, 5.0


def cpu_seconds(run: sp.Run) -> float:
    """The CPU seconds a run of this part takes here: FS's set-up of N clients, K turns a round, the evaluations."""
    return CLIENTS * SETUP_SECONDS + SAMPLED * run.rounds * TURN_SECONDS + (run.rounds // EVERY + 1) * EVAL_SECONDS


def part_seconds() -> float:
    """The CPU seconds of the whole part before any run: a run without and one with DP per method (the server's
    clip and noise cost nothing beside the clients' turns)."""
    return 2 * len(METHODS) * cpu_seconds(sp.Run(STAGE, "device", "fedit", (), SEED, ROUNDS))
