"""Baselines selected by federate.method in stock FS, each with its defining property (issue: baselines)."""

from __future__ import annotations

import json

import pytest
import torch

from tests.integration.conftest import fedpa_cfg, probe

pytestmark = pytest.mark.integration


def _records(run):
    with open(f"{run['final']['outdir']}/fedpa_diagnostics.jsonl") as f:
        return [json.loads(line) for line in f]


def test_fedit_global_factors_are_the_weighted_means_of_the_uploads(tiny_llm, tmp_path):
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "fedit"}), tmp_path)
    for agg in run["aggregate"]:
        total = sum(agg["weights"])
        for name, (B_g, A_g) in agg["global"].items():
            B = sum(w / total * u[name][0] for w, u in zip(agg["weights"], agg["uploads"]))
            A = sum(w / total * u[name][1] for w, u in zip(agg["weights"], agg["uploads"]))
            torch.testing.assert_close(B_g, B)
            torch.testing.assert_close(A_g, A)
    # FedIT's product of means is not the mean of products: a positive aggregation error
    assert all(r["e_agg"] > 0 for r in _records(run))


def test_flexlora_restarts_clients_from_the_global_factors(tiny_llm, tmp_path):
    flex = probe(fedpa_cfg(tiny_llm, tmp_path / "flex", **{"federate.method": "flexlora"}), tmp_path / "flex")
    fedpa = probe(fedpa_cfg(tiny_llm, tmp_path / "fedpa"), tmp_path / "fedpa")
    # E_init: FlexLoRA replaces the local factors by the re-factorised global ones, FedPA keeps them
    flex_init = [v for r in _records(flex)[1:] for v in r["e_init_B"].values()]
    fedpa_init = [v for r in _records(fedpa)[1:] for v in r["e_init_B"].values()]
    assert flex_init and all(v > 0 for v in flex_init)
    assert fedpa_init and all(v == 0 for v in fedpa_init)
    # and each FlexLoRA client starts round t+1 from the truncated global of round t
    globals_ = {agg["round"]: agg["global"] for agg in flex["aggregate"]}
    for entry in flex["enter"]:
        if entry["round"] == 0:
            continue
        for name, (B, A) in entry["start"].items():
            B_g, A_g = globals_[entry["round"] - 1][name]
            scale = 8 / B.shape[1]  # PEFT alpha / r: the client stores raw factors
            torch.testing.assert_close(scale * B @ A, B_g @ A_g)  # same product, rank r_i = R_g here
    # no alignment term is added
    assert all(gap == 0.0 for gap in flex["loss_gap"])


def test_ffa_lora_never_changes_A(tiny_llm, tmp_path):
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "ffa_lora"}), tmp_path)
    first = run["enter"][0]["start"]
    for record in run["enter"] + [{"start": r["end"]} for r in run["leave"]]:
        for name, (_, A) in record["start"].items():
            assert torch.equal(A, first[name][1])
    assert any(not torch.equal(r["end"][n][0], first[n][0]) for r in run["leave"] for n in first)  # B trains


@pytest.mark.parametrize("share", [True, False])
def test_fedsa_lora_clients_keep_their_own_B(tiny_llm, tmp_path, share):
    cfg = fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "fedsa_lora", "federate.share_local_model": share})
    run = probe(cfg, tmp_path)
    ends = {(r["client"], r["round"]): r["end"] for r in run["leave"]}
    for entry in run["enter"]:
        previous = ends.get((entry["client"], entry["round"] - 1))
        if previous is None:
            continue
        for name, (B, A) in entry["start"].items():
            assert torch.equal(B, previous[name][0])  # its own B ...
            assert not torch.equal(A, previous[name][1])  # ... and the global A
    final = run["final"]["clients"]
    name = next(iter(final[1]))
    assert not torch.equal(final[1][name][0], final[2][name][0])


def test_rolora_trains_B_then_A(tiny_llm, tmp_path):
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "rolora"}), tmp_path)
    starts = {(e["client"], e["round"]): e["start"] for e in run["enter"]}
    for leave in run["leave"]:
        start = starts[(leave["client"], leave["round"])]
        frozen = 1 if leave["round"] % 2 == 0 else 0  # round 0: A frozen, round 1: B frozen
        for name, factors in leave["end"].items():
            assert torch.equal(factors[frozen], start[name][frozen])
            assert not torch.equal(factors[1 - frozen], start[name][1 - frozen])


def test_fedrot_lora_rotation_preserves_each_clients_product(tiny_llm, tmp_path):
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "fedrot_lora"}), tmp_path)
    ends = {(r["client"], r["round"]): r["end"] for r in run["leave"]}
    for agg in run["aggregate"]:
        for client, upload in zip(agg["clients"], agg["uploads"]):
            for name, (B, A) in upload.items():
                B_raw, A_raw = ends[(client, agg["round"])][name]
                expected = (8 / B_raw.shape[1]) * B_raw.double() @ A_raw.double()  # PEFT alpha / r
                torch.testing.assert_close(B.double() @ A.double(), expected, atol=1e-5, rtol=1e-5)
                rotated = not torch.equal(A, A_raw)
                assert rotated is (agg["round"] > 0)  # round 0 has nothing to align to


@pytest.mark.parametrize("method", ["hetlora_pad", "hetlora"])
def test_hetlora_pads_to_the_largest_rank_and_truncates_back(tiny_llm, tmp_path, method):
    # hetlora with its self-pruning off here: the padding and truncation are the same
    options = {"federate.method": method, "fedpa.client_ranks": [2, 4, 8], "fedpa.hetlora.lam": 0.0}
    cfg = fedpa_cfg(tiny_llm, tmp_path, **options)
    run = probe(cfg, tmp_path)
    assert {r["client"]: r["upload_ranks"] for r in run["leave"]} == {1: [2], 2: [4], 3: [8]}
    assert all(B.shape[1] == 8 for agg in run["aggregate"] for B, _ in agg["global"].values())
    for entry in run["enter"]:
        if entry["round"] > 0:
            B_g = run["aggregate"][entry["round"] - 1]["global"]
            for name, (B, A) in entry["start"].items():
                r = B.shape[1]
                scale = 8 / r
                torch.testing.assert_close(scale * B, B_g[name][0][:, :r])  # the first r_i columns
                torch.testing.assert_close(A, B_g[name][1][:r])


def test_fedpa_without_preservation_restarts_from_the_reference_and_still_aligns(tiny_llm, tmp_path):
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "fedpa_no_preservation"}), tmp_path)
    assert all(v > 0 for r in _records(run)[1:] for v in r["e_init_B"].values())
    assert any(gap > 0 for gap in run["loss_gap"])


def test_fedpa_partial_restart_starts_between_its_own_factors_and_the_reference(tiny_llm, tmp_path):
    # heterogeneous ranks with references below and at r_i: the reference's missing columns/rows are zero
    mu, R = 0.3, {1: 2, 2: 2, 3: 4}
    options = {"federate.method": "fedpa_partial_restart", "fedpa.fedpa_partial_restart.mu": mu,
               "fedpa.client_ranks": [2, 4, 8], "fedpa.reference_ranks": [2, 2, 4]}  # fmt: skip
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **options), tmp_path)
    ends = {(r["client"], r["round"]): r["end"] for r in run["leave"]}  # PEFT's raw B / s_i, A
    checked = 0
    for entry in run["enter"]:
        if entry["round"] == 0:
            continue
        c, B_g = entry["client"], run["aggregate"][entry["round"] - 1]["global"]
        for name, (B, A) in entry["start"].items():
            r, m = B.shape[1], R[c]
            B_end, A_end = ends[(c, entry["round"] - 1)][name]
            B_ref, A_ref = torch.zeros_like(B), torch.zeros_like(A)
            B_ref[:, :m], A_ref[:m] = B_g[name][0][:, :m] / (8 / r), B_g[name][1][:m]  # PEFT alpha / r
            torch.testing.assert_close(B, (1 - mu) * B_end + mu * B_ref)
            torch.testing.assert_close(A, (1 - mu) * A_end + mu * A_ref)
            checked += 1
    assert checked > 0 and any(gap > 0 for gap in run["loss_gap"])


def test_hetlora_self_pruning_only_lowers_ranks_and_the_server_follows(tiny_llm, tmp_path):
    # gamma 0.7 prunes visibly: rank 8 -> 5 -> 3 ..., rank 2 -> 1, never below 1
    options = {"federate.method": "hetlora", "fedpa.client_ranks": [2, 4, 8], "fedpa.hetlora.gamma": 0.7}
    sgd = {"fedpa.hetlora.lam": 10.0, "train.optimizer.type": "SGD", "train.optimizer.lr": 0.05}  # the tail shrinks
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **options, **sgd), tmp_path)
    ranks: dict[int, list[int]] = {}
    for leave in sorted(run["leave"], key=lambda r: r["round"]):
        ranks.setdefault(leave["client"], []).append(max(leave["upload_ranks"]))
    assert all(
        r == sorted(r, reverse=True) and r[0] <= {1: 2, 2: 4, 3: 8}[c] and min(r) >= 1 for c, r in ranks.items()
    )
    assert any(r[-1] < {1: 2, 2: 4, 3: 8}[c] for c, r in ranks.items())  # something was pruned
    assert len(run["aggregate"]) == 3 and all(len(a["clients"]) == 3 for a in run["aggregate"])  # nothing dropped
    for entry in run["enter"]:  # a client starts from the global factors at its current (pruned) rank
        if entry["round"] > 0:
            previous = ranks[entry["client"]][entry["round"] - 1]
            assert all(B.shape[1] == previous for B, _ in entry["start"].values())


@pytest.mark.parametrize("method, ranks", [("fedex_lora", None), ("flora", "[2, 4, 3]")])
def test_exact_methods_merge_the_average_update_into_every_clients_base_and_pay_for_it(
    tiny_llm, tmp_path, method, ranks
):
    opts = {"federate.method": method} | ({"fedpa.client_ranks": ranks} if ranks else {})
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **opts), tmp_path)
    records = _records(run)
    assert all(r["e_agg_rel"] < 1e-5 for r in records)  # exact: the adapter plus the merge is the average
    # Independently of the plugin: the weighted average of the uploads (applied factors) each round
    averages = []
    for agg in run["aggregate"]:
        total = sum(agg["weights"])
        averages.append(
            {
                n: sum(w / total * u[n][0] @ u[n][1] for w, u in zip(agg["weights"], agg["uploads"]))
                for n in agg["global"]
            }
        )
    # Each round's global model is the base the clients trained on plus that average: the next round starts there
    bases = {(e["client"], e["round"]): e["base"] for e in run["enter"]}
    assert run["enter"] and all(e["base"] for e in run["enter"])
    for entry in run["enter"]:
        for name, (B, A) in entry["start"].items():
            model = entry["base"][name] + 8 / B.shape[1] * B @ A  # what the client's model applies
            t = entry["round"]
            expected = bases[entry["client"], t - 1][name] + averages[t - 1][name] if t else bases[1, 0][name]
            torch.testing.assert_close(model, expected, atol=1e-5, rtol=0)
            if method == "flora":
                assert not B.any()  # a fresh LoRA every round
    # Bytes from each method's definition, float32, summed over modules
    shapes = {n: (B.shape[0], A.shape[1]) for n, (B, A) in run["final"]["global"].items()}
    r = {1: 2, 2: 4, 3: 3} if ranks else {1: 4, 2: 4, 3: 4}
    for record in records:
        for c, sent in record["bytes_up"].items():
            assert sent == 4 * sum(r[int(c)] * (d + k) for d, k in shapes.values())
        for c, got in record["bytes_down"].items():
            if method == "fedex_lora":  # the reference (B_bar, A_bar) and, from round 1, the dense residual
                expected = sum(4 * (d + k) + (d * k if record["round"] else 0) for d, k in shapes.values()) * 4
            else:  # no reference; from round 1, the stack of every client's factors
                expected = 4 * sum(sum(r.values()) * (d + k) for d, k in shapes.values()) if record["round"] else 0
            assert got == expected, (record["round"], c)


@pytest.mark.parametrize("method", ["feddpa_t", "feddpa_f"])
def test_feddpa_trains_a_personal_adapter_that_never_leaves_the_client(tiny_llm, tmp_path, method):
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": method}), tmp_path)
    phases = run["personal"]
    assert sorted({p["round"] for p in phases}) == [1, 2]  # round 0: the global phase only
    w0 = {n: t for e in run["enter"] if e["round"] == 0 for n, t in e["base"].items()}
    after = {(p["client"], p["round"]): p["after"] for p in phases}
    for p in phases:
        prev = after.get((p["client"], p["round"] - 1))
        for n, (B, A) in p["start"].items():
            B_r, A_r = p["received"][n]  # client space, which is PEFT's raw space at r_i = r
            # the mixed forward: (1 - a) of the received global frozen in the base weights, a * s on the personal one
            torch.testing.assert_close(p["base"][n] - w0[n], 0.5 * (8 / 4) * B_r @ A_r, atol=1e-6, rtol=0)
            assert p["scaling"][n] == pytest.approx(0.5 * 8 / 4)
            if method == "feddpa_f":  # restarts from the fresh global every round
                assert torch.equal(B, B_r) and torch.equal(A, A_r)
            elif prev is None:  # FedDPA-T's first personal phase: PEFT's initialisation
                assert not B.any() and A.any()
            else:  # FedDPA-T continues its own trajectory, bit for bit
                assert torch.equal(B, prev[n][0]) and torch.equal(A, prev[n][1])
    # the upload is the global phase's factors (applied), never the personal ones
    ends = {(r["client"], r["round"]): r["end"] for r in run["leave"]}
    for sent in run["sent"]:
        end = ends[sent["client"], sent["round"]]
        for n, parts in sent["parts"].items():
            assert torch.equal(parts["B"], (8 / 4) * end[n][0]) and torch.equal(parts["A"], end[n][1])
            personal = after.get((sent["client"], sent["round"]))
            if personal is not None:
                assert not torch.equal(personal[n][0], end[n][0])
    # the global phase trains on W_0, from the received global factors, as FedIT
    assert all(torch.equal(e["base"][n], w0[n]) for e in run["enter"] for n in e["base"])
    assert all(r["e_agg"] > 0 for r in _records(run))  # factor-wise averaging of the global adapters
    # test time: every evaluated input of a client with a personal adapter gets its own weight g of the global adapter
    assert {(m["client"], m["round"]) for m in run["instance"]} == {(c, t) for c in (1, 2, 3) for t in (1, 2)}
    for mix in run["instance"]:
        assert mix["split"] == 4 and len(mix["g"]) > 1  # the global reference's rank; one weight per input
        assert float(mix["g"].abs().max()) <= 0.5 and len(set(mix["g"].tolist())) > 1


def test_fed_plora_trains_its_drawn_modules_on_the_folded_rest_and_the_server_averages_each_module(tiny_llm, tmp_path):
    ranks = {1: 1, 2: 2, 3: 4}  # R = 4
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "fed_plora", "fedpa.client_ranks": "[1, 2, 4]"}),
                tmp_path)  # fmt: skip
    w0 = {n: t for e in run["enter"] if e["round"] == 0 for n, t in e["base"].items()}
    drawn = {}
    for e in run["enter"]:
        r_i = ranks[e["client"]]
        for n, (B, A) in e["start"].items():
            B_g, A_g = e["received"][n]  # applied factors, all R modules
            assert B.shape[1] == r_i and B_g.shape[1] == 4
            # which received modules the client trains: found from the data, not from the plugin's draw
            cols = [next(j for j in range(4) if torch.allclose(8 / r_i * B[:, c], B_g[:, j], rtol=0, atol=1e-7)
                         and torch.equal(A[c], A_g[j])) for c in range(r_i)]  # fmt: skip
            assert len(set(cols)) == r_i
            drawn.setdefault((e["client"], e["round"]), cols)
            assert drawn[e["client"], e["round"]] == cols  # one draw for every layer
            # zero initialisation noise: base (W_0 + the undrawn modules) + the drawn ones = the global product
            torch.testing.assert_close(e["base"][n] - w0[n] + 8 / r_i * B @ A, B_g @ A_g, atol=1e-6, rtol=0)
    assert any(len({tuple(drawn[c, t]) for t in range(3)}) > 1 for c in (1, 2))  # re-drawn between rounds
    # The server: each module is the unweighted mean over the clients that drew it, of what they sent
    sent = {(s["client"], s["round"]): s["parts"] for s in run["sent"]}
    previous = {e["round"]: e["received"] for e in run["enter"] if e["client"] == 1}
    for agg in run["aggregate"]:
        t = agg["round"]
        for n, (B_new, A_new) in agg["global"].items():
            for j in range(4):
                Q = [(c, drawn[c, t].index(j)) for c in agg["clients"] if j in drawn[c, t]]
                if not Q:
                    b, a = previous[t][n][0][:, j], previous[t][n][1][j]
                else:
                    b = sum(sent[c, t][n]["B"][:, pos] for c, pos in Q) / len(Q)
                    a = sum(sent[c, t][n]["A"][pos] for c, pos in Q) / len(Q)
                torch.testing.assert_close(B_new[:, j], b, atol=1e-6, rtol=0)
                torch.testing.assert_close(A_new[j], a, atol=1e-6, rtol=0)
    # The drift diagnostic compares the client's whole update (drawn + folded) with the received global product:
    # only the drawn modules moved
    records = {r["round"]: r for r in _records(run)}
    for (c, t), cols in drawn.items():
        received = next(e["received"] for e in run["enter"] if (e["client"], e["round"]) == (c, t))
        moved = sum(float((sent[c, t][n]["B"] @ sent[c, t][n]["A"] - B[:, cols] @ A[cols]).norm()) ** 2
                    for n, (B, A) in received.items())  # fmt: skip
        assert records[t]["drift"][str(c)] == pytest.approx(moved**0.5, rel=1e-4, abs=1e-7)
    # Bytes: up the r_i drawn modules, down all R of them (float32, summed over modules)
    shapes = {n: (B.shape[0], A.shape[1]) for n, (B, A) in run["final"]["global"].items()}
    for record in _records(run):
        for c, got in record["bytes_up"].items():
            assert got == 4 * sum(ranks[int(c)] * (d + k) for d, k in shapes.values())
        assert set(record["bytes_down"].values()) == {4 * sum(4 * (d + k) for d, k in shapes.values())}


def test_fed_plora_is_evaluated_with_its_own_factors_on_the_base_it_trained_them_on(tiny_llm, tmp_path):
    opts = {"federate.method": "fed_plora", "fedpa.client_ranks": "[1, 2, 4]", "fedpa.eval.local": True}
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **opts), tmp_path)
    w0 = {n: t for e in run["enter"] if e["round"] == 0 for n, t in e["base"].items()}
    enter = {(e["client"], e["round"]): e for e in run["enter"]}
    leave = {(e["client"], e["round"]): e for e in run["leave"]}
    evaluations = {}
    for e in run["evaluate"]:
        evaluations.setdefault((e["client"], e["round"]), []).append(e)
    folded = 0
    for (c, t), (paper, own) in ((key, pair) for key, pair in evaluations.items() if len(pair) == 2):
        trained = [r for client, r in leave if client == c and r <= t]
        for n, base in paper["base"].items():  # the paper protocol: the global modules on W_0 alone
            torch.testing.assert_close(base, w0[n], atol=0, rtol=0)
        if not trained:
            continue
        last = max(trained)
        for n, base in own["base"].items():  # its own: the modules it kept, on W_0 + the modules it did not draw
            torch.testing.assert_close(base, enter[c, last]["base"][n], atol=0, rtol=0)
            folded += not torch.equal(base, w0[n])
        for n, (B, A) in own["factors"].items():
            assert torch.equal(B, leave[c, last]["end"][n][0]) and torch.equal(A, leave[c, last]["end"][n][1])
    assert folded  # some client's undrawn modules were not zero: the case the base must carry


def test_ravan_keeps_its_bases_trains_only_its_heads_and_the_server_averages_each_head(tiny_llm, tmp_path):
    heads = {1: 1, 2: 2, 3: 4}  # K_i = r_i / min r_i of H = 4 heads
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "ravan", "fedpa.client_ranks": "[1, 2, 4]"}),
                tmp_path)  # fmt: skip
    bases, drawn = run["enter"][0]["start"], {}
    for e in run["enter"]:
        c, t = e["client"], e["round"]
        for n, (B, A) in e["start"].items():  # the frozen bases: the same for every client in every round
            assert torch.equal(B, bases[n][0]) and torch.equal(A, bases[n][1])
        chosen = {tuple(v) for v in e["trainable"].values()}
        assert len(chosen) == 1 and len(next(iter(chosen))) == heads[c]  # K_i heads, the same in every layer
        drawn[c, t] = list(next(iter(chosen)))
        for n, (cores, scales) in e["heads"].items():  # from the received cores, every scale back at 1
            assert torch.equal(cores, e["received"][n][0]) and torch.equal(scales, torch.ones(4))
    assert any(len({tuple(drawn[c, t]) for t in range(3)}) > 1 for c in (1, 2))  # re-drawn between rounds
    # only the trained heads moved (cores and scales), the others are the received ones bit for bit
    starts = {(e["client"], e["round"]): e["heads"] for e in run["enter"]}
    for leave in run["leave"]:
        key = (leave["client"], leave["round"])
        for n, (cores, scales) in leave["end"].items():
            start = starts[key][n]
            for h in range(4):
                moved = not torch.equal(cores[h], start[0][h]) and float(scales[h]) != 1.0
                assert moved == (h in drawn[key]), (key, n, h)
    # the server: each head is the unweighted mean over the clients that trained it of the s_h H_h they sent
    sent = {(s["client"], s["round"]): s["parts"] for s in run["sent"]}
    ends = {(r["client"], r["round"]): r["end"] for r in run["leave"]}
    previous = {e["round"]: e["received"] for e in run["enter"] if e["client"] == 1}
    for agg in run["aggregate"]:
        t = agg["round"]
        for n, (H_new, s_new) in agg["global"].items():
            assert torch.equal(s_new, torch.ones(4))
            for h in range(4):
                C = [c for c in agg["clients"] if h in drawn[c, t]]
                for c in C:  # what travelled is s_h H_h of the client's trained head
                    cores, scales = ends[c, t][n]
                    torch.testing.assert_close(sent[c, t][n]["B"][drawn[c, t].index(h)], scales[h] * cores[h])
                want = sum(sent[c, t][n]["B"][drawn[c, t].index(h)] for c in C) / len(C) if C else previous[t][n][0][h]
                torch.testing.assert_close(H_new[h], want, atol=1e-7, rtol=0)
    # Bytes: up the K_i trained r_h x r_h cores, down all H cores and their H scales (float32, summed over modules)
    r_h = {n: H.shape[1] for n, (H, _) in run["final"]["global"].items()}
    for record in _records(run):
        for c, got in record["bytes_up"].items():
            assert got == 4 * sum(heads[int(c)] * r**2 for r in r_h.values())
        assert set(record["bytes_down"].values()) == {4 * sum(4 * r**2 + 4 for r in r_h.values())}
        assert record["e_agg_rel"] > 0 or len(record["clients"]) < 3  # heads differ in who trained them


def test_ravan_with_every_head_trained_by_every_client_aggregates_exactly(tiny_llm, tmp_path):
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "ravan", "fedpa.ravan.heads": "[2, 2, 2]"}),
                tmp_path)  # fmt: skip
    records = _records(run)
    assert all(r["e_agg_rel"] < 1e-6 and r["global_update_norm"] > 0 for r in records)  # Eq. 8: exact


def test_lora_fair_corrects_the_averaged_B_and_its_clients_start_from_the_corrected_global(tiny_llm, tmp_path):
    run = probe(fedpa_cfg(tiny_llm, tmp_path, **{"federate.method": "lora_fair"}), tmp_path)
    for agg in run["aggregate"]:
        total = sum(agg["weights"])
        for name, (B_g, A_g) in agg["global"].items():
            X = sum(w / total * u[name][0] @ u[name][1] for w, u in zip(agg["weights"], agg["uploads"]))
            B_bar = sum(w / total * u[name][0] for w, u in zip(agg["weights"], agg["uploads"]))
            A_bar = sum(w / total * u[name][1] for w, u in zip(agg["weights"], agg["uploads"]))
            torch.testing.assert_close(A_g, A_bar)  # A is FedIT's average
            assert not torch.equal(B_g, B_bar)  # B is corrected ...
            # ... toward the average product: lower E_agg than FedIT's on the same uploads
            assert float((X - B_g @ A_g).norm()) < float((X - B_bar @ A_bar).norm())
    globals_ = {agg["round"]: agg["global"] for agg in run["aggregate"]}
    for entry in run["enter"]:  # Avg-Initial: every client loads the corrected global factors
        if entry["round"]:
            for name, (B, A) in entry["start"].items():
                torch.testing.assert_close(8 / 4 * B, globals_[entry["round"] - 1][name][0])
                torch.testing.assert_close(A, globals_[entry["round"] - 1][name][1])
