"""The server's aggregator as a collaborator: built from the method, a round log, the shapes and the global model it
reads the round from and installs the result into, it checks, aggregates, records and installs without a server
(issue 60), and returns {} to FS (the install wrote the model); the result is compared with a dense SVD of the
weighted sum of the uploads' products."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from fs_fedpa.config_sections import RecordsConfig

pytest.importorskip(
    "federatedscope", reason="FederatedScope is not installed: the server's aggregator is NOT checked "
    "(pip install --no-deps ../shared/vendor/FederatedScope-llm-*.tar.gz)"
)  # fmt: skip

SHAPES = {"q": (7, 5), "v": (7, 5)}
r, R_g = 2, 3


def _aggregator(tmp_path, name="fedpa", **kw):
    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.core.ranks import RankPlan
    from fs_fedpa.methods import METHODS, get_method
    from fs_fedpa.plugin.aggregator import FedPAAggregator
    from fs_fedpa.plugin.record_fs import RoundLog

    get_method(name)
    method = METHODS[name](FedPAConfig(), RankPlan.build(3, r, global_rank=R_g))
    rounds = RoundLog(str(tmp_path), RecordsConfig(diagnostics="full"))
    opened, installed = [], []

    class Installed:  # the server's GlobalModel, as the aggregator sees it
        def round_input(self):
            return opened[-1]

        def adopt(self, done):
            installed.append(done)

    aggregator = FedPAAggregator(method, rounds, global_model=Installed(), shapes=(SHAPES, {}), **kw)
    aggregator.opened, aggregator.installed = opened, installed  # the test's view of both ends
    return aggregator, rounds


def _sit_out_policy():
    """The sample-level DP policy's rule for an upload whose account took no DP-SGD step, alone (its checks of each
    account are tests/unit/privacy/test_sample_level_server.py's)."""
    from fs_fedpa.privacy.policy import ServerPolicy
    from fs_fedpa.privacy.sample_level import SampleLevelServer

    class SitOut(ServerPolicy):
        set_aside = SampleLevelServer.set_aside

    return SitOut()


def _records(log) -> list[dict]:
    """The round records the log wrote: its diagnostics file, the run's history."""
    path = Path(log.path)
    return [json.loads(line) for line in path.read_text().splitlines()] if path.exists() else []


def _upload(seed: int, scale: float = 1.0):
    g = torch.Generator().manual_seed(seed)
    return {n: (scale * torch.randn(d, r, generator=g), torch.randn(r, k, generator=g)) for n, (d, k) in SHAPES.items()}


def _start(aggregator, rnd=4):
    from fs_fedpa.aggregation import RoundInput

    zero = {n: (torch.zeros(d, R_g), torch.zeros(R_g, k)) for n, (d, k) in SHAPES.items()}
    aggregator.opened.append(RoundInput(rnd, (1, 2, 3), zero, {1: 11, 2: 12, 3: 13}))


def _message(factors, size):
    from fs_fedpa.plugin.payload import encode_factors

    return size, {"lora": encode_factors(factors), "stats": {"lam": 1.0, "num_train_data": size}}


def _best_rank(M: torch.Tensor, k: int) -> torch.Tensor:
    U, S, Vh = torch.linalg.svd(M.double())
    return (U[:, :k] * S[:k]) @ Vh[:k]


def test_the_aggregator_needs_no_server_and_gives_the_best_rank_R_g_approximation(tmp_path):
    aggregator, rounds = _aggregator(tmp_path)
    assert not hasattr(aggregator, "server")
    _start(aggregator)
    uploads, sizes = [_upload(s) for s in (1, 2, 3)], [10, 30, 60]
    returned = aggregator.aggregate({"client_feedback": [_message(u, n) for u, n in zip(uploads, sizes)],
                                     "staleness": [(1, 0), (2, 0), (3, 0)]})  # fmt: skip
    assert returned == {}  # the install wrote the model: FS merges nothing more into it
    (done,) = aggregator.installed
    assert done.lost == () and done.merge is None
    for name in SHAPES:
        dense = sum(n / 100 * (u[name][0].double() @ u[name][1].double()) for u, n in zip(uploads, sizes))
        B, A = done.global_factors[name]
        assert B.shape[1] == R_g
        torch.testing.assert_close(B.double() @ A.double(), _best_rank(dense, R_g), rtol=1e-4, atol=1e-5)
    (record,) = _records(rounds)
    assert record["round"] == 4 and record["clients"] == [1, 2, 3]
    assert record["bytes_down"] == {"1": 11, "2": 12, "3": 13}
    assert record["weights"] == [10, 30, 60]  # as given; the method normalises them


def test_a_bad_upload_is_dropped_with_its_reason_and_the_others_aggregate(tmp_path):
    aggregator, rounds = _aggregator(tmp_path)
    _start(aggregator, rnd=0)
    good, bad = _upload(1), _upload(2)
    bad["q"] = (torch.full_like(bad["q"][0], float("nan")), bad["q"][1])
    aggregator.aggregate({"client_feedback": [_message(good, 5), _message(bad, 5)], "staleness": [(1, 0), (2, 0)]})
    (record,) = _records(rounds)
    assert record["clients"] == [1] and "2" in record["dropped"]
    for name in SHAPES:
        B, A = aggregator.installed[-1].global_factors[name]
        dense = good[name][0].double() @ good[name][1].double()
        torch.testing.assert_close(B.double() @ A.double(), dense, rtol=1e-4, atol=1e-5)


def test_a_round_without_an_upload_installs_nothing_and_the_limit_stops_the_run(tmp_path):
    from fs_fedpa.config import FedPAConfig

    aggregator, rounds = _aggregator(tmp_path)
    aggregator.method.cfg = FedPAConfig(max_failed_rounds=2)
    for rnd in (0, 1):
        _start(aggregator, rnd)
        feedback = {"client_feedback": [(5, {"lora": "not a dict"})], "staleness": [(1, 0)]}
        if rnd == 0:
            assert aggregator.aggregate(feedback) == {}  # FS merges nothing: the model stays as it was
        else:
            with pytest.raises(RuntimeError, match="2 rounds in a row"):
                aggregator.aggregate(feedback)
        assert aggregator.installed == []
    assert [rec["clients"] for rec in _records(rounds)] == [[], []]


@pytest.mark.parametrize("ignore_weight", [False, True])
def test_a_client_that_took_no_dp_step_weighs_nothing(tmp_path, ignore_weight):
    """fedpa.dp.min_records: a client too small for DP-SGD sends its untrained factors with its account (0 steps).
    Before, a method that weighs by num_train_data (FlexLoRA) or federate.ignore_weight gave them full weight. The
    global is then the dense SVD of the others' products alone."""
    aggregator, rounds = _aggregator(tmp_path, ignore_weight=ignore_weight, privacy=_sit_out_policy())
    _start(aggregator)
    uploads = [_upload(s) for s in (1, 2, 3)]
    messages = [_message(u, n) for u, n in zip(uploads, (10, 30, 60))]
    for (_, content), steps in zip(messages, (4, 0, 4)):
        content["stats"]["dp_steps"] = steps
    aggregator.aggregate({"client_feedback": messages, "staleness": [(1, 0), (2, 0), (3, 0)]})
    weights = (0.5, 0.0, 0.5) if ignore_weight else (10 / 70, 0.0, 60 / 70)
    for name in SHAPES:
        dense = sum(w * (u[name][0].double() @ u[name][1].double()) for u, w in zip(uploads, weights))
        B, A = aggregator.installed[-1].global_factors[name]
        torch.testing.assert_close(B.double() @ A.double(), _best_rank(dense, R_g), rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("name", ["fedpa", "fedit"])
def test_a_round_whose_only_upload_took_no_dp_step_keeps_the_global(tmp_path, name):
    """Issue 88: a sit-out account (0 steps) with a x10^4 upload became the whole global when it was the round's only
    upload (all weights 0 were weighed equally), and an honest sit-out alone in its round set FedPA's global to its
    untrained factors (B = 0). Now such an upload is not aggregated: the round installs nothing, FS merges nothing
    (the global stays), the record names the client, and the round does not count as a failed one."""
    # Prepare
    aggregator, rounds = _aggregator(tmp_path, name, privacy=_sit_out_policy())
    _start(aggregator)
    size, content = _message(_upload(1, scale=1e4), 10)
    content["stats"]["dp_steps"] = 0
    # Execute
    returned = aggregator.aggregate({"client_feedback": [(size, content)], "staleness": [(2, 0)]})
    # Assert
    assert returned == {} and aggregator.installed == [] and aggregator.failed_in_a_row == 0
    (record,) = _records(rounds)
    assert record["clients"] == [] and "no DP-SGD step" in record["dropped"]["2"]


def test_an_upload_that_took_no_dp_step_has_no_influence_whatever_the_method_weighs(tmp_path):
    """HetLoRA weighs uploads by their norms, not by the weights the server gives: a sit-out's x10^4 upload beside
    honest ones took the global over. Now the global is the method's aggregate of the honest uploads alone."""
    # Prepare
    aggregator, _ = _aggregator(tmp_path, "hetlora", privacy=_sit_out_policy())
    _start(aggregator)
    honest = [_upload(1), _upload(3)]
    messages = [_message(honest[0], 10), _message(_upload(2, scale=1e4), 30), _message(honest[1], 60)]
    for (_, content), steps in zip(messages, (4, 0, 4)):
        content["stats"]["dp_steps"] = steps
    # Execute
    aggregator.aggregate({"client_feedback": messages, "staleness": [(1, 0), (2, 0), (3, 0)]})
    # Assert: HetLoRA's rule on the honest uploads alone, computed here: (sum_i p_i B_i)(sum_i p_i A_i) with p_i
    # proportional to ||B_i A_i||_F (zero padding to its rank changes no product)
    for name in SHAPES:
        norms = [float(torch.linalg.matrix_norm(u[name][0].double() @ u[name][1].double())) for u in honest]
        p = [n / sum(norms) for n in norms]
        B_mean = sum(w * u[name][0].double() for w, u in zip(p, honest))
        A_mean = sum(w * u[name][1].double() for w, u in zip(p, honest))
        B, A = aggregator.installed[-1].global_factors[name]
        torch.testing.assert_close(B.double() @ A.double(), B_mean @ A_mean, rtol=1e-4, atol=1e-5)


def test_without_dp_the_aggregation_reads_no_dp_sgd_statistic(tmp_path):
    """Issue 89: setting aside an upload whose account says 0 DP-SGD steps is the sample-level policy's business, not
    the aggregator's: without DP such a stat is a diagnostic like any other, and the upload weighs its sample size."""
    # Prepare
    aggregator, rounds = _aggregator(tmp_path)
    _start(aggregator)
    uploads = [_upload(s) for s in (1, 2)]
    messages = [_message(u, n) for u, n in zip(uploads, (10, 30))]
    messages[1][1]["stats"]["dp_steps"] = 0
    # Execute
    aggregator.aggregate({"client_feedback": messages, "staleness": [(1, 0), (2, 0)]})
    # Assert
    (record,) = _records(rounds)
    assert record["clients"] == [1, 2] and record["dropped"] == {}
    for name in SHAPES:
        dense = sum(w * (u[name][0].double() @ u[name][1].double()) for u, w in zip(uploads, (0.25, 0.75)))
        B, A = aggregator.installed[-1].global_factors[name]
        torch.testing.assert_close(B.double() @ A.double(), _best_rank(dense, R_g), rtol=1e-4, atol=1e-5)
