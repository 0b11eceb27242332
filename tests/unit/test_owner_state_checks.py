"""Each owner of a resume point's part checks its own saved state (issue 89): fed one bad field, its ``check_state``
refuses with one line naming the file and the field, and the server loads no part before every part passed. The
round log's part carries no round history: the diagnostics file is the history, checked by its size and SHA-256."""

from __future__ import annotations

import io
import json
import re

import pytest
import torch

pytest.importorskip(
    "federatedscope", reason="FederatedScope is not installed: the owners' checks of saved state are NOT checked "
    "(pip install --no-deps ../shared/vendor/FederatedScope-llm-*.tar.gz)"
)  # fmt: skip

from fs_fedpa.config_sections import RecordsConfig  # noqa: E402
from fs_fedpa.record import DIAGNOSTICS_FILE  # noqa: E402


def _refused(check, *named: str, args=()) -> str:
    """The one-line message ``check(*args)`` refuses with, which names each of ``named``."""
    with pytest.raises(ValueError) as caught:
        check(*args)
    message = str(caught.value)
    assert "\n" not in message and all(n in message for n in named), message
    return message


def _record(rnd: int, clients: list[int]) -> dict:
    return {"round": rnd, "clients": clients, "bytes_up": {str(c): 10 for c in clients}, "bytes_down": {"1": 5},
            "e_agg": None, "e_agg_rel": None, "alignment_loss_mean": None, "spectrum_probe": [0.5] * 64}  # fmt: skip


# ---------------------------------------------------------------------------------------------- the round log
def _log(folder, level="light"):
    from fs_fedpa.plugin.record_fs import RoundLog

    folder.mkdir(parents=True, exist_ok=True)
    return RoundLog(str(folder), RecordsConfig(diagnostics=level))


def test_the_round_logs_part_holds_no_record_and_its_size_does_not_grow_with_the_rounds(tmp_path):
    """Before (07b6cca): every record so far, in every resume point (its part grew by a record a round)."""
    sizes = []
    for rounds in (1, 40):
        log = _log(tmp_path / str(rounds))
        for rnd in range(rounds):
            log.add(_record(rnd, [1 + rnd % 3]))
        state = log.state_dict()
        assert not any(isinstance(v, list) and v and isinstance(v[0], dict) for v in state.values()), state
        buffer = io.BytesIO()
        torch.save(state, buffer)
        sizes.append(len(buffer.getvalue()))
        assert state["clients"] == sorted({1 + r % 3 for r in range(rounds)})
        assert state["file_size"] == (tmp_path / str(rounds) / DIAGNOSTICS_FILE).stat().st_size
    assert sizes[1] - sizes[0] < 64, sizes  # the clients' ids and the totals' digits, not 39 records


def test_a_resume_continues_the_diagnostics_file_up_to_the_point_and_drops_later_lines(tmp_path):
    killed = _log(tmp_path / "killed")
    for rnd in range(3):
        killed.add(_record(rnd, [1, 2]))
    state = killed.state_dict()
    lines = (tmp_path / "killed" / DIAGNOSTICS_FILE).read_text().splitlines()
    killed.add(_record(3, [1]))  # after the point: the resumed run trains round 3 again
    resumed = _log(tmp_path / "resumed")
    resumed.check_state(state, "p.pt", 3)
    resumed.load_state_dict(state, "p.pt")
    assert resumed.totals == {"up": 60, "down": 15} and resumed.clients == {1, 2}
    resumed.add(_record(3, [2]))
    again = (tmp_path / "resumed" / DIAGNOSTICS_FILE).read_text().splitlines()
    assert again[:3] == lines and len(again) == 4 and json.loads(again[3])["bytes_up_total"] == 70
    # the resumed run's own point vouches for the whole file: a second resume continues from it
    _log(tmp_path / "twice").check_state(resumed.state_dict(), "p2.pt", 4)


def test_a_changed_or_other_diagnostics_file_is_refused_and_a_gone_one_is_warned_of(tmp_path, monkeypatch):
    from fs_fedpa.plugin import record_fs

    killed = _log(tmp_path / "killed")
    for rnd in range(2):
        killed.add(_record(rnd, [1]))
    state, path = killed.state_dict(), tmp_path / "killed" / DIAGNOSTICS_FILE
    text = path.read_text()
    path.write_text(text.replace('"round": 0', '"round": 9'))
    _refused(lambda: _log(tmp_path / "a").check_state(state, "p.pt", 2), f"the diagnostics file {str(path)!r}",
             "'round_log.file_sha256'", "p.pt")  # fmt: skip
    path.write_text(text[:-5])  # truncated: shorter than the point recorded
    _refused(lambda: _log(tmp_path / "b").check_state(state, "p.pt", 2), str(path), "'round_log.file_sha256'")
    path.unlink()
    resumed = _log(tmp_path / "c")
    resumed.check_state(state, "p.pt", 2)
    warned = []
    monkeypatch.setattr(record_fs.logger, "warning", warned.append)
    resumed.load_state_dict(state, "p.pt")
    assert len(warned) == 1 and str(path) in warned[0] and "is not there" in warned[0], warned
    _log(tmp_path / "d", "off").check_state({**state, "file_sha256": "0" * 64}, "p.pt", 2)  # writes none: no history


def test_the_round_log_refuses_each_malformed_field_naming_it(tmp_path):
    good = _log(tmp_path / "run").state_dict()
    for key in good:
        _refused(_log(tmp_path / "x").check_state, "'p.pt'", f"no field 'round_log.{key}'",
                 args=({k: v for k, v in good.items() if k != key}, "p.pt", 2))  # fmt: skip
    for key, value, named in (("clients", [0], "field 'round_log.clients' is [0]"),
                              ("clients", "1", "field 'round_log.clients' is '1'"),
                              ("totals", {"up": -1, "down": 0}, "field 'round_log.totals.up' is -1"),
                              ("totals", [1], "field 'round_log.totals' is a list"),
                              ("file", 3, "field 'round_log.file' is 3"),
                              ("file_size", -2, "field 'round_log.file_size' is -2"),
                              ("file_sha256", "ab", "field 'round_log.file_sha256' is 'ab'")):  # fmt: skip
        _refused(_log(tmp_path / "x").check_state, "'p.pt'", named, args=({**good, key: value}, "p.pt", 2))


# ---------------------------------------------------------------------------------------------- the other owners
def test_the_aggregator_and_fs_results_refuse_their_malformed_fields_naming_each():
    from types import SimpleNamespace

    from fs_fedpa.plugin.aggregator import FedPAAggregator
    from fs_fedpa.plugin.resume_fs import FSResults

    aggregator = FedPAAggregator(method=None, round_log=None)
    good = aggregator.state_dict()
    aggregator.check_state(good, "p.pt", 2)
    for state, named in (({**good, "failed_in_a_row": -1}, "field 'aggregator.failed_in_a_row' is -1"),
                         ({**good, "generator": torch.zeros(5, dtype=torch.uint8)}, "field 'aggregator.generator' is"),
                         ({"generator": good["generator"]}, "no field 'aggregator.failed_in_a_row'")):  # fmt: skip
        _refused(aggregator.check_state, "'p.pt'", named, args=(state, "p.pt", 2))
    results = FSResults(SimpleNamespace(history_results={}, best_results={}))
    results.check_state(results.state_dict(), "p.pt", 2)
    for state, named in (
        ({"history_results": [1, 2], "best_results": {}}, "field 'fs_results.history_results' is a list"),
        ({"history_results": {}, "best_results": None}, "field 'fs_results.best_results' is a NoneType"),
        ({"history_results": {}}, "no field 'fs_results.best_results'"),
    ):  # fmt: skip
        _refused(results.check_state, "'p.pt'", named, args=(state, "p.pt", 2))


def test_the_global_model_refuses_its_malformed_factors_bytes_and_merges_naming_each():
    from tests.unit.test_global_model import _server_side

    _, g = _server_side(R_g=5)
    good = g.state_dict()
    g.check_state(good, "p.pt", 2)
    name = next(iter(good["factors"]))
    B, A = good["factors"][name]
    nan = B.clone()
    nan[0, 0] = float("nan")
    merges = good["merges"]
    for key, value, named in (
        ("factors", {**good["factors"], name: (nan, A)}, f"field 'global_model.factors[{name!r}]' B holds a NaN"),
        ("factors", {}, "field 'global_model.factors' does not have the modules"),
        ("down_bytes", {1: -3}, "field 'global_model.down_bytes' is {1: -3}"),
        ("merges", {**merges, "merged": {"elsewhere": torch.zeros(2, 2)}}, "field 'global_model.merges.merged'"),
        ("merges", {**merges, "count": "2"}, "field 'global_model.merges.count' is '2'"),
        ("merges", {**merges, "kept": {1: 4}}, "field 'global_model.merges.kept' is {1: 4}"),
        ("merges", {k: v for k, v in merges.items() if k != "last"}, "no field 'global_model.merges.last'"),
    ):  # fmt: skip
        _refused(g.check_state, "'p.pt'", named, args=({**good, key: value}, "p.pt", 2))
    _refused(lambda: g.check_state({k: v for k, v in good.items() if k != "down_bytes"}, "p.pt", 2),
             "no field 'global_model.down_bytes'")  # fmt: skip


def test_a_clients_state_refuses_its_malformed_fields_naming_the_file_and_each():
    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.core.ranks import RankPlan
    from fs_fedpa.methods import get_method
    from fs_fedpa.plugin.client_state import ClientState

    method = get_method("fedpa")(FedPAConfig(), RankPlan.build(2, 2))
    method.bind({"q": (6, 5)})
    initial = {"q": (torch.zeros(6, 2), torch.zeros(2, 5))}
    local = {"head": torch.zeros(3)}
    good = {"factors": {"q": (torch.randn(6, 2), torch.randn(2, 5))}, "local": {"head": torch.ones(3)},
            "base_offset": {}, "personal": {}, "rounds_trained": 2}  # fmt: skip

    def check(saved):
        return lambda: ClientState.check_state(saved, "c.pt.client1.r3", 3, method=method, initial=initial,
                                               local=local)  # fmt: skip

    check(good)()
    for key, value, named in (
        ("rounds_trained", 0, "field 'rounds_trained' is 0; it must be an int from 1 to 4"),
        ("factors", {"q": (torch.randn(6, 3), torch.randn(3, 5))}, "field 'factors['q']' has shapes B (6, 3)"),
        ("local", {"head": torch.full((3,), float("inf"))}, "field 'local['head']' holds a NaN or an Inf"),
        ("base_offset", {"k": torch.zeros(6, 5)}, "field 'base_offset' does not have this run's tensors"),
    ):  # fmt: skip
        _refused(check({**good, key: value}), "resume file c.pt.client1.r3", named)


def test_the_dp_policy_refuses_its_counts_fields_and_another_ledger_naming_each(tmp_path):
    pytest.importorskip("dp_accounting", reason="dp-accounting (the dp extra) is not installed")
    from tests.unit.privacy.test_sample_level_server import _server

    server = _server(tmp_path)
    server.write({"round": 0, "dp_mode": server.level, "dp_clients": {}})
    good = server.state_dict()
    server.check_state(good, "p.pt", 2)
    for state, named in (({**good, "trained": {1: 5}}, "field 'privacy.trained[1]' is 5; it must be an int from 0"),
                         ({**good, "ledger_size": "9"}, "field 'privacy.ledger_size' is a str, not a int"),
                         ({**good, "generator": torch.zeros(3, dtype=torch.uint8)}, "field 'privacy.generator' is"),
                         ({**good, "ledger_sha256": "0" * 64}, f"the DP ledger {good['ledger']!r}")):  # fmt: skip
        _refused(server.check_state, "p.pt", named, args=(state, "p.pt", 2))


def test_the_server_loads_no_part_before_every_part_passed_its_owners_check(monkeypatch):
    from types import SimpleNamespace

    from fs_fedpa import resume
    from fs_fedpa.plugin.resume_fs import ServerResume

    loaded = []

    class Part:
        def __init__(self, name, bad=False):
            self.name, self.bad, self.model = name, bad, SimpleNamespace(state_dict=dict)

        def check_state(self, state, path, rnd):
            if self.bad:
                raise ValueError(f"federate.restore_from {path!r}: field '{self.name}.x' is bad")

        def load_state_dict(self, state, path):
            loaded.append(self.name)

    point = {**dict.fromkeys(resume.HEAD_FIELDS), "round": 2, "client_files": {},
             **{name: {} for name in resume.PARTS}, "round_log": {"clients": []}}  # fmt: skip
    monkeypatch.setattr(ServerResume, "read", lambda self, path, **kw: ({"model": {}}, point))
    server = ServerResume(cfg=None, method=None)
    parts = {name: Part(name, bad=name == resume.PARTS[-1]) for name in resume.PARTS}
    message = _refused(lambda: server.restore("p.pt", parts, global_factors={}, local={}, clients=0, rounds=3),
                       f"field '{resume.PARTS[-1]}.x'")  # fmt: skip
    assert loaded == [], message
    parts[resume.PARTS[-1]].bad = False
    server.restore("p.pt", parts, global_factors={}, local={}, clients=0, rounds=3)
    assert loaded == list(resume.PARTS)
    assert re.fullmatch(r"[a-z_]+", resume.PARTS[0])
