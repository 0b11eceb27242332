"""fs_fedpa.plugin.fs_patches is the one file of FS seams: each target it names is where it says in the installed
FederatedScope (file, line, signature), so an FS upgrade that moves one fails here, loudly, before a run; and no
other module of the package patches FS's objects."""

from __future__ import annotations

import importlib
import inspect
import re
from pathlib import Path

import pytest

from fs_fedpa.plugin.fs_patches import FS_COMMIT, SEAMS

ROOT = Path(__file__).resolve().parents[2]
fs = pytest.importorskip(
    "federatedscope", reason="FederatedScope is not installed: the FS seams of fs_fedpa/plugin/fs_patches.py are "
    "NOT checked (pip install --no-deps ../shared/vendor/FederatedScope-llm-*.tar.gz)"
)  # fmt: skip


@pytest.mark.parametrize("seam", SEAMS, ids=[s.target.split(":")[1] for s in SEAMS])
def test_each_seam_is_where_fs_fedpa_patches_it(seam):
    module_name, qualified = seam.target.split(":")
    target = importlib.import_module(module_name)
    for part in qualified.split("."):
        target = getattr(target, part)
    source, line = inspect.getsourcelines(target)
    where = Path(inspect.getsourcefile(target)).as_posix()
    assert where.endswith(seam.file) and (line, source[0].strip()) == (seam.line, seam.signature), (
        f"FS moved {qualified}: now {where}:{line} {source[0].strip()!r}, where fs_patches.SEAMS (FS {FS_COMMIT}) has "
        f"{seam.file}:{seam.line} {seam.signature!r}; read what the plugin does there ({seam.use}) against the new FS "
        "before updating the seam"
    )


PATCHING = re.compile(
    r"(comm_manager\.(receive|send)\s*=[^=])|(Message\.count_bytes\s*=[^=])|(finish_fed_runner\s*=[^=])"
    r"|(hooks_in_train\[)"
)


def test_no_other_module_patches_fs():
    offenders = []
    for path in sorted((ROOT / "fs_fedpa").rglob("*.py")):
        if path.name == "fs_patches.py":
            continue
        for number, line in enumerate(path.read_text().splitlines(), 1):
            if PATCHING.search(line.split("#")[0]):
                offenders.append(f"{path.relative_to(ROOT)}:{number}: {line.strip()}")
    assert not offenders, "FS patched outside fs_fedpa/plugin/fs_patches.py:\n" + "\n".join(offenders)


def test_the_byte_counter_is_replaced_once_and_keeps_the_original_underneath():
    from federatedscope.core.message import Message

    from fs_fedpa.plugin import fs_patches

    before = Message.count_bytes
    calls = []

    def make(original):
        def count_bytes(message):
            calls.append(original)
            return 0, 0

        return count_bytes

    try:
        if getattr(before, "fedpa_guard", False):  # the plugin's guard is already in place in this process
            fs_patches.guard_count_bytes(make)
            assert Message.count_bytes is before  # once per process: a second call changes nothing
        else:
            fs_patches.guard_count_bytes(make)
            fs_patches.guard_count_bytes(make)
            Message(msg_type="x", sender=0, receiver=[1], content={}).count_bytes()
            assert calls == [before]
    finally:
        Message.count_bytes = before


class _CountingPickle:
    """FS's client module's ``pickle`` in these tests: the real one, recording every object it is asked to pickle."""

    def __init__(self):
        self.calls = []

    def dumps(self, obj, *args, **kwargs):
        import pickle

        self.calls.append(obj)
        return pickle.dumps(obj, *args, **kwargs)


@pytest.fixture
def counting_pickle(monkeypatch):
    from federatedscope.core.workers import client as fs_client

    counting = _CountingPickle()
    monkeypatch.setattr(fs_client, "pickle", counting)
    return fs_client, counting


def test_sized_once_pickles_a_shared_model_once_and_gives_fs_the_same_size(counting_pickle):
    import pickle
    import sys

    import torch

    from fs_fedpa.plugin.fs_patches import sized_once

    fs_client, counting = counting_pickle
    model, other = torch.nn.Linear(64, 32), torch.nn.Linear(8, 4)
    expected = sys.getsizeof(pickle.dumps(model))
    for _ in range(3):  # three clients built on one shared model
        with sized_once(model):
            assert sys.getsizeof(fs_client.pickle.dumps(model)) == expected  # FS's expression, line 147
            assert sys.getsizeof(fs_client.pickle.dumps(other)) == sys.getsizeof(pickle.dumps(other))
    assert [c is model for c in counting.calls] == [True, False, False, False]  # the model once, the other each time
    assert fs_client.pickle is counting  # restored on leaving


def test_sized_once_raises_for_an_unpicklable_model_every_time_as_fs_expects(counting_pickle):
    """FS catches the error and sizes the model 1.0; the shim tries to pickle it once and raises the same error for
    every client after."""
    import pickle

    import torch

    from fs_fedpa.plugin.fs_patches import sized_once

    fs_client, counting = counting_pickle
    model = torch.nn.Linear(4, 2)
    model.hook = lambda x: x  # a local lambda: pickle raises
    for _ in range(3):
        with sized_once(model), pytest.raises((AttributeError, pickle.PicklingError)):
            fs_client.pickle.dumps(model)
    assert len(counting.calls) == 1
