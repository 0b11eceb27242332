"""A resume point's tensors are checked for what they claim to be before any of their values is read."""

from __future__ import annotations

import io
import re
import time
from pathlib import Path

import pytest
import torch

from fs_fedpa import resume, state_checks


def _planted(size: int) -> torch.Tensor:
    """A (size, size) view over one float, as ``torch.load(weights_only=True)`` gives it back from a planted file."""
    buffer = io.BytesIO()
    torch.save(torch.zeros(1).expand(size, size), buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def test_a_planted_stride_0_view_is_refused_before_its_values_are_read():
    huge = _planted(10**6)  # 10^12 elements over 4 bytes: isfinite over it would need 1 TB
    assert huge.stride() == (0, 0)
    start = time.perf_counter()
    planted = r"field 'global_model\.factors\['layer'\]' B is a view of shape \(1000000, 1000000\)"
    with pytest.raises(ValueError, match=planted):
        state_checks.check_global({"layer": (huge, torch.zeros(2, 8))}, "point.pt", {"layer": (torch.zeros(8, 2),
                            torch.zeros(2, 8))}, max_rank=2)  # fmt: skip
    assert time.perf_counter() - start < 5  # refused from its strides, not after reading it
    # the same view at the expected shape is refused too: its storage holds one value for 16
    with pytest.raises(ValueError, match="over a smaller storage"):
        state_checks.check_global({"layer": (_planted(8)[:, :2], torch.zeros(2, 8))}, "point.pt",
                            {"layer": (torch.zeros(8, 2), torch.zeros(2, 8))}, max_rank=2)  # fmt: skip


def test_well_formed_factors_pass_and_a_nan_is_still_named():
    initial = {"layer": (torch.zeros(8, 2), torch.zeros(2, 8))}
    state_checks.check_global({"layer": (torch.randn(8, 2), torch.randn(2, 8).T.contiguous().T)}, "p", initial, 2)
    bad = torch.randn(2, 8)
    bad[0, 0] = float("nan")
    with pytest.raises(ValueError, match="holds a NaN or an Inf"):
        state_checks.check_global({"layer": (torch.randn(8, 2), bad)}, "p", initial, 2)


def test_a_resume_point_of_another_version_is_refused_naming_both():
    with pytest.raises(ValueError, match=r"version 1; this fs_fedpa reads version 6"):
        resume.check_server_fields({"method": "fedpa", "round": 2}, "old.pt")  # before version 2: no field


def test_a_version_4_point_is_refused_saying_it_carries_the_history():
    with pytest.raises(ValueError, match=r"old\.pt' is a resume point of version 4 \(it carries the whole round "
                       r"history; the diagnostics file is the history now\); this fs_fedpa reads version 6 only"):
        resume.check_server_fields({**_whole_point(), "version": 4}, "old.pt")


def test_a_version_5_point_is_refused_saying_it_has_no_run_report():
    with pytest.raises(ValueError, match=r"version 5 \(it has no run report: the resumed run's summary.json would "
                       r"lose the evaluations before it\); this fs_fedpa reads version 6 only"):
        resume.check_server_fields({**_whole_point(), "version": 5}, "old.pt")


def _whole_point() -> dict:
    parts = {part: {} for part in resume.PARTS}  # each part's own fields are its owner's (test_owner_state_checks)
    return {"version": resume.VERSION, "method": "fedpa", "round": 2, "plan": [[4], [4], 4], "settings": {},
            "rng": resume.rng_state(), "client_files": {}, **parts}  # fmt: skip


def test_a_whole_envelope_passes_and_each_missing_or_malformed_part_is_refused_naming_it():
    resume.check_server_fields(_whole_point(), "p.pt")  # the refusals below are each for the one thing removed
    for part in resume.PARTS:
        saved = _whole_point()
        del saved[part]
        with pytest.raises(ValueError, match=rf"p\.pt.* no field '{part}'"):
            resume.check_server_fields(saved, "p.pt")
        saved = _whole_point()
        saved[part] = [1]
        with pytest.raises(ValueError, match=rf"p\.pt.*: field '{part}' is a list, not a mapping"):
            resume.check_server_fields(saved, "p.pt")
    for key in resume.HEAD_FIELDS[1:]:
        saved = _whole_point()
        del saved[key]
        with pytest.raises(ValueError, match=rf"p\.pt.* no field '{key}'"):
            resume.check_server_fields(saved, "p.pt")


def test_hetlora_restores_its_pruned_ranks_and_refuses_others():
    from fs_fedpa.config import FedPAConfig
    from fs_fedpa.core.ranks import RankPlan
    from fs_fedpa.methods import get_method

    plan = RankPlan.build(3, 4, client_ranks=[1, 2, 4])
    method = get_method("hetlora")(FedPAConfig(client_ranks=[1, 2, 4]), plan)
    method.current = [1, 2, 3]
    fresh = get_method("hetlora")(FedPAConfig(client_ranks=[1, 2, 4]), plan)
    fresh.check_state(method.state_dict(), "p.pt", 3)
    fresh.load_state_dict(method.state_dict(), "p.pt")
    assert fresh.current == [1, 2, 3]
    for bad in ({"current": [1, 3, 3]}, {"current": [1, 2]}, {}, {"current": "x"}, {"current": [1, 2, 3], "x": 1}):
        with pytest.raises(ValueError, match=r"p\.pt.*: field 'method_state\.current'"):
            fresh.check_state(bad, "p.pt", 3)
    with pytest.raises(ValueError, match=r"p\.pt.*: field 'method_state' holds \['current'\], which fedpa does not"):
        get_method("fedpa")(FedPAConfig(), plan).check_state({"current": [1]}, "p.pt", 3)


# ---------------------------------------------------------------------------------------------- issue 88: files
def _fifo(tmp_path):
    import os

    path = tmp_path / "fifo"
    os.mkfifo(path)
    return path


def _sparse(tmp_path, size=20 * 2**30):
    path = tmp_path / "sparse"
    with open(path, "wb") as f:
        f.truncate(size)  # 20 GB of holes: no disk, but read whole it would take 20 GB of memory
    return path


def _within(seconds: float, call):
    """``call()``'s exception (or None), failing the test if it has not returned after ``seconds``: a read that
    blocks on a FIFO must fail the test, not hang it."""
    import threading

    outcome = {}

    def run():
        try:
            call()
        except BaseException as exc:  # noqa: BLE001
            outcome["exc"] = exc

    thread = threading.Thread(target=run, daemon=True)
    thread.start()
    thread.join(seconds)
    assert not thread.is_alive(), f"still reading after {seconds} s (it blocks)"
    return outcome.get("exc")


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "sparse_20GB", "folder"])
def test_a_resume_file_that_is_no_regular_file_or_too_big_is_refused_unread(tmp_path, kind):
    """Issue 88: a FIFO blocked the resume forever; /dev/zero or a 20 GB sparse file would be read whole. Now each is
    refused, naming the file, from its type and size (never opened blocking, never read)."""
    from fs_fedpa import export

    path = {"fifo": _fifo, "dev_zero": lambda _: Path("/dev/zero"), "sparse_20GB": _sparse,
            "folder": lambda p: p}[kind](tmp_path)  # fmt: skip
    reason = {"fifo": "it is a FIFO, not a regular file", "dev_zero": "it is a device, not a regular file",
              "sparse_20GB": "it is 21474836480 bytes, more than the", "folder": "it is a folder"}[kind]  # fmt: skip
    for read in (lambda: resume.load(path, limit=2**30), lambda: export.read_checkpoint(path, limit=2**30)):
        exc = _within(10, read)
        assert isinstance(exc, ValueError) and str(path) in str(exc) and reason in str(exc), repr(exc)
        assert "\n" not in str(exc)


@pytest.mark.parametrize("kind", ["fifo", "dev_zero", "sparse_20GB"])
def test_a_dp_ledger_that_is_no_regular_file_or_too_big_is_refused_unread(tmp_path, kind):
    from fs_fedpa.privacy.private import read_ledger

    path = {"fifo": _fifo, "dev_zero": lambda _: Path("/dev/zero"), "sparse_20GB": _sparse}[kind](tmp_path)
    exc = _within(10, lambda: read_ledger(str(path), lambda line: True, 2**24))
    assert isinstance(exc, ValueError) and f"the DP ledger {str(path)!r}" in str(exc), repr(exc)
    assert "not a regular file" in str(exc) or "more than the 16777216" in str(exc)


def _rng_cases():
    good = resume.rng_state()
    cases = {
        "torch a list": {**good, "torch": [1, 2, 3]},
        "torch too short": {**good, "torch": good["torch"][:10]},
        "numpy a string": {**good, "numpy": "MT19937"},
        "numpy keys short": {**good, "numpy": [good["numpy"][0], good["numpy"][1][:5], *good["numpy"][2:]]},
        "random None": {**good, "random": None},
        "random garbled": {**good, "random": (3, (1, 2), None)},
    }
    return good, cases


def test_a_malformed_rng_is_refused_naming_the_file_and_the_field():
    """Issue 88: a malformed ``rng`` ended in a bare TypeError/RuntimeError when the round started. Each is refused
    by the point's check, naming the file and ``rng.<generator>``."""
    good, cases = _rng_cases()
    resume.check_rng(good, "point.pt", "rng")  # the process's own states pass
    for name, rng in cases.items():
        saved = _whole_point()
        saved["rng"] = rng
        with pytest.raises(ValueError, match=r"point\.pt'?: field 'rng\.(torch|numpy|random)' is "):
            resume.check_server_fields(saved, "point.pt")


def test_malformed_client_files_are_refused_naming_the_field():
    saved = _whole_point()
    saved["client_files"] = {1: "x"}
    with pytest.raises(ValueError, match=re.escape("field 'client_files' is not a mapping")):
        resume.check_server_fields(saved, "p.pt")


def test_a_resume_point_without_fs_model_or_round_is_refused_naming_the_field():
    """Issue 88: a point without ``model`` died in FS's loader with a bare KeyError."""
    for checkpoint, named in (({"cur_round": 2}, "field 'model' is missing"),
                              ({"cur_round": 2, "model": [1]}, "field 'model' is a list"),
                              ({"model": {}}, "field 'cur_round' is 'missing'")):  # fmt: skip
        with pytest.raises(ValueError, match=re.escape(named)):
            resume.check_checkpoint(checkpoint, "p.pt")
    resume.check_checkpoint({"cur_round": 2, "model": {"w": torch.zeros(2)}}, "p.pt")
