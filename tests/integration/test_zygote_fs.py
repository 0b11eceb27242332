"""The tests' zygote (tests/integration/zygote.py) runs a module as a fresh interpreter would: the same FS run bit for
bit, and the same cwd, argv, environment, stdin, exit status, traceback and timeout as ``subprocess.run``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from tests.conftest import ROOT
from tests.integration import zygote
from tests.integration.tiny_assets import fs_env, fs_glue_yaml, outdir_of, read_eval_results, run_fs, run_module

pytestmark = pytest.mark.integration

ECHO = """
import json, os, sys
print(json.dumps({"cwd": os.getcwd(), "argv": sys.argv[1:], "probe": os.environ.get("FS_PROBE_X"),
                  "path0": sys.path[0], "stdin": sys.stdin.read(), "name": __name__}))
print("to stderr", file=sys.stderr)
what = sys.argv[1]
if what == "raise":
    raise ValueError("raised on purpose")
if what == "exit":
    sys.exit("exit message")
if what == "code":
    sys.exit(3)
if what == "sleep":
    import time
    time.sleep(60)
"""


def _comparable(row):
    """An eval_results row with NaN (FS's empty fairness bins) made equal to itself."""
    if isinstance(row, dict):
        return {k: _comparable(v) for k, v in row.items()}
    return "nan" if isinstance(row, float) and row != row else row


def test_a_forked_fs_run_equals_a_fresh_interpreters_bit_for_bit(tiny_glue, tmp_path, monkeypatch):
    runs = {}
    for how in ("zygote", "fresh"):
        folder = tmp_path / how
        save_to = str(folder / "ckpt" / "model.pt")
        cfg = fs_glue_yaml(folder, tiny_glue["model"], tiny_glue["glue"], **{"federate.save_to": save_to})
        monkeypatch.setenv(zygote.FRESH, "1" if how == "fresh" else "0")
        proc = run_fs(cfg, folder)
        assert proc.returncode == 0, proc.stderr[-3000:]
        assert "Starting training" in proc.stdout + proc.stderr  # FS's log reached the captured output
        checkpoint = torch.load(folder / "ckpt" / "final_model.pt", weights_only=True)
        runs[how] = read_eval_results(outdir_of(cfg)), checkpoint["fedpa"]["global"]
    assert zygote._zygote is not None and zygote._zygote.proc.poll() is None  # the first run did go to the zygote
    # every metric of every evaluation (FS orders a line's keys by the interpreter's hash seed, so not the text)
    assert len(runs["zygote"][0]) == len(runs["fresh"][0]) > 2
    assert [_comparable(r) for r in runs["zygote"][0]] == [_comparable(r) for r in runs["fresh"][0]]
    assert runs["zygote"][1].keys() == runs["fresh"][1].keys()
    for name, (B, A) in runs["zygote"][1].items():
        assert torch.equal(B, runs["fresh"][1][name][0]) and torch.equal(A, runs["fresh"][1][name][1])


@pytest.mark.parametrize("what", ["ok", "raise", "exit", "code"])
def test_a_forked_module_sees_and_returns_what_a_fresh_interpreter_does(tmp_path, what):
    (tmp_path / "echo_mod.py").write_text(ECHO)
    env = fs_env({"FS_PROBE_X": "seen"})
    forked = run_module("echo_mod", [what, 7], tmp_path, env, 60)
    fresh = subprocess.run([sys.executable, "-m", "echo_mod", what, "7"], cwd=tmp_path, env=env, capture_output=True,
                           text=True, timeout=120, stdin=subprocess.DEVNULL)  # fmt: skip
    assert forked.returncode == fresh.returncode == {"ok": 0, "raise": 1, "exit": 1, "code": 3}[what]
    assert forked.stdout == fresh.stdout and '"probe": "seen"' in fresh.stdout and '"name": "__main__"' in fresh.stdout
    tail = [line for line in fresh.stderr.splitlines() if not line.startswith(" ")]
    assert [line for line in forked.stderr.splitlines() if not line.startswith(" ")] == tail  # frames differ: runpy's
    assert zygote._zygote.takes(env)  # it ran in the zygote


def test_a_timeout_kills_the_child_and_the_zygote_goes_on(tmp_path):
    (tmp_path / "echo_mod.py").write_text(ECHO)
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        run_module("echo_mod", ["sleep"], tmp_path, fs_env(), 2)
    assert "to stderr" in caught.value.stderr
    assert run_module("echo_mod", ["ok"], tmp_path, fs_env(), 60).returncode == 0


def test_what_would_import_differently_runs_in_a_fresh_interpreter(tmp_path):
    (tmp_path / "echo_mod.py").write_text(ECHO)
    assert run_module("echo_mod", ["ok"], tmp_path, fs_env(), 60).returncode == 0
    assert not zygote._zygote.takes(fs_env({"PYTHONWARNINGS": "default"}))
    assert not zygote._zygote.takes(fs_env({"PYTHONPATH": str(ROOT)}))
    proc = run_module("echo_mod", ["ok"], tmp_path, fs_env(), 60, python_args=["-S"])  # no site: a fresh one
    assert proc.returncode == 0 and Path(str(tmp_path)).name in proc.stdout


WHOSE = "import os, sys\nprint(os.getppid(), *sys.argv[1:])\n"  # who started it: the zygote, or this process


def test_a_zygote_slower_than_its_limit_never_fails_a_run(tmp_path, monkeypatch):
    # Prepare: a zygote whose imports (a sleep) outlast the limit, as on a busy host (issue 88: "the test zygote did
    # not fork" failed every FS test)
    (tmp_path / "whose_mod.py").write_text(WHOSE)
    monkeypatch.setenv(zygote.FORK_LIMIT, "2")
    slow = zygote.Zygote({**zygote._import_env(fs_env()), zygote.SLOW: "1000"}, str(ROOT))
    try:
        # Execute, Assert: the run goes to a fresh interpreter, a child of this process, and succeeds
        proc = slow.run("whose_mod", ["a"], tmp_path, fs_env(), 60)
        assert proc.returncode == 0 and proc.stdout.split() == [str(os.getpid()), "a"], proc.stderr[-2000:]
    finally:
        slow.proc.kill()
        slow.proc.wait()


def test_a_zygote_that_becomes_ready_takes_the_next_runs(tmp_path, monkeypatch):
    (tmp_path / "whose_mod.py").write_text(WHOSE)
    import time

    monkeypatch.setenv(zygote.FORK_LIMIT, "1")
    late = zygote.Zygote({**zygote._import_env(fs_env()), zygote.SLOW: "3"}, str(ROOT))
    try:
        first = late.run("whose_mod", ["a"], tmp_path, fs_env(), 60)  # not ready within 1 s: a fresh interpreter
        assert first.returncode == 0 and first.stdout.split() == [str(os.getpid()), "a"], first.stderr[-2000:]
        # the runs after it no longer wait: fresh interpreters until the zygote is ready, then its children
        deadline = time.monotonic() + 120
        while (later := late.run("whose_mod", ["b"], tmp_path, fs_env(), 60)).stdout.split()[0] == str(os.getpid()):
            assert time.monotonic() < deadline, "the zygote never became ready"
            time.sleep(0.2)
        assert later.returncode == 0 and later.stdout.split() == [str(late.proc.pid), "b"], later.stderr[-2000:]
    finally:
        late.proc.kill()
        late.proc.wait()
