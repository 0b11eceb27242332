"""The client state store: a budget in host memory, least recently used clients spilled to safetensors and read back
bit for bit; a spilled file that is missing, cut short or of another shape is that client's loss alone."""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from fs_fedpa.state_store import SpillError, StateStore, flatten, nbytes, unflatten


def _state(seed: int, d: int = 8, r: int = 2) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return flatten({
        "factors": {"layer.0.q": (torch.randn(d, r, generator=g), torch.randn(r, d, generator=g))},
        "local": {"classifier.weight": torch.randn(2, d, generator=g, dtype=torch.float64)},
        "personal": None,
        "base_offset": {},
    })  # fmt: skip


def test_flatten_and_unflatten_are_inverse_and_drop_empty_parts():
    state = _state(0)
    parts = unflatten(state)
    assert set(parts) == {"factors", "local"}
    B, A = parts["factors"]["layer.0.q"]
    assert torch.equal(B, state["factors|layer.0.q|0"]) and torch.equal(A, state["factors|layer.0.q|1"])
    assert flatten(parts).keys() == state.keys()


def test_store_keeps_everything_in_memory_without_a_budget(tmp_path):
    store = StateStore(tmp_path / "spill")
    for c in range(1, 6):
        store.put(c, _state(c))
    assert store.spills == 0 and store.memory_bytes == 5 * nbytes(_state(1)) and store.disk_bytes == 0
    assert not (tmp_path / "spill").exists()


def test_store_spills_least_recently_used_beyond_the_budget_and_reads_back_bit_for_bit(tmp_path):
    one = nbytes(_state(1))
    store = StateStore(tmp_path, budget_bytes=2 * one)
    for c in (1, 2, 3):
        store.put(c, _state(c))
    assert store.memory_bytes <= 2 * one and (tmp_path / "client_1.safetensors").is_file()  # 1 was used least lately
    store.get(2)  # 2 is now the most recent: putting 4 spills 3
    store.put(4, _state(4))
    assert {p.name for p in tmp_path.glob("*.safetensors")} == {"client_1.safetensors", "client_3.safetensors"}
    for c in (1, 2, 3, 4):  # independent expectation: the state rebuilt from its seed
        got = store.get(c)
        assert got.keys() == _state(c).keys()
        assert all(torch.equal(got[k], v) and got[k].dtype == v.dtype for k, v in _state(c).items())
    assert store.memory_bytes <= 2 * one and store.reads >= 2  # reading one back spills another


def test_put_copies_so_later_changes_of_the_callers_tensors_do_not_leak(tmp_path):
    store, state = StateStore(tmp_path), _state(0)
    store.put(1, state)
    state["local|classifier.weight"].add_(1.0)
    assert torch.equal(store.get(1)["local|classifier.weight"], _state(0)["local|classifier.weight"])


def _relink(path, target):
    path.unlink()
    path.symlink_to(target)


def _huge_header(path):
    """A safetensors file of the written size, with the written owner (copied from the file), whose header claims a
    tensor of 2^40 floats."""
    import json
    import struct

    data = path.read_bytes()
    owner = json.loads(data[8 : 8 + struct.unpack("<Q", data[:8])[0]])["__metadata__"]
    claim = {"__metadata__": owner, "x": {"dtype": "F32", "shape": [2**40], "data_offsets": [0, 4 * 2**40]}}
    header = json.dumps(claim).encode()
    body = struct.pack("<Q", len(header)) + header
    path.write_bytes(body + b" " * (len(data) - len(body)))


def _pickle(path):
    """A pickle of the same tensors (``torch.save``), padded to the written size where it is shorter."""
    from safetensors.torch import load_file

    size, state = path.stat().st_size, {k: v.clone() for k, v in load_file(str(path)).items()}
    torch.save(state, path)
    if path.stat().st_size < size:
        with open(path, "ab") as f:
            f.write(b"\0" * (size - path.stat().st_size))


def _edit_in_place(path):
    """One byte of the last tensor's data changed, in place: the size, the header and so the owner and shapes stay."""
    data = bytearray(path.read_bytes())
    data[-1] ^= 0x40
    path.write_bytes(bytes(data))


def _swap(path):
    """Client 1's and client 2's files exchanged (same shapes, same size)."""
    other, tmp = path.parent / "client_2.safetensors", path.parent / "swap.tmp"
    os.replace(path, tmp)
    os.replace(other, path)
    os.replace(tmp, other)


@pytest.mark.parametrize(
    "damage, message",
    [
        (lambda p: p.unlink(), "is missing"),
        (lambda p: shutil.rmtree(p.parent), "is missing"),  # its folder deleted
        (lambda p: p.write_bytes(p.read_bytes()[:40]), r"is 40 bytes, written as \d+"),
        (lambda p: os.truncate(p, 20 * 2**30), r"is 21474836480 bytes, written as"),  # grown (sparse: no disk used)
        (lambda p: _rewrite(p, {"factors|layer.0.q|0": torch.zeros(3, 3)}), "bytes, written as"),
        (lambda p: _rewrite(p, None), "bytes, written as"),
        (lambda p: _relink(p, "/dev/zero"), "is a link \\(to '/dev/zero'\\)"),
        (lambda p: _relink(p, p.parent / "client_2.safetensors"), "is a link"),
        (_huge_header, "cannot be read"),
        (_pickle, "cannot be read|bytes, written as"),
        (_swap, "was written for client '2'"),
        (_edit_in_place, "its blake2b digest differs"),  # same size, owner and shapes: read back silently before
    ],
)
def test_a_damaged_spill_is_that_clients_error_only(tmp_path, damage, message):
    store = StateStore(tmp_path, budget_bytes=1)  # everything but the newest spills
    store.put(1, _state(1))
    store.put(2, _state(2))
    store.put(4, _state(4))  # 2 is spilled too: a file to swap with or link to
    damage(tmp_path / "client_1.safetensors")
    with pytest.raises(SpillError, match=message) as info:
        store.get(1)
    assert info.value.client == 1 and "client #1" in str(info.value)
    assert 1 not in store and store.get(1) is None  # gone, not half-read
    store.put(3, _state(3))  # the others are untouched (or, where the damage took theirs too, refused)
    try:
        assert all(torch.equal(store.get(2)[k], v) for k, v in _state(2).items())
    except SpillError as err:
        assert damage in (_swap,) or "is missing" in str(err), err
    assert all(torch.equal(store.get(4)[k], v) for k, v in _state(4).items())


def _rewrite(path, tensors):
    from safetensors.torch import load_file, save_file

    state = load_file(str(path))
    if tensors is None:  # same names, one of another shape
        state["factors|layer.0.q|0"] = torch.zeros(8, 3)
    else:
        state = tensors
    save_file(state, str(path))


def test_drop_forgets_memory_and_file(tmp_path):
    store = StateStore(tmp_path, budget_bytes=1)
    store.put(1, _state(1))
    store.put(2, _state(2))
    store.drop(1)
    store.drop(2)
    assert store.memory_bytes == 0 and not list(tmp_path.glob("*.safetensors")) and 1 not in store


@settings(max_examples=40, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["put", "get"]), st.integers(1, 6)), min_size=1, max_size=40),
       st.integers(0, 4))  # fmt: skip
def test_any_sequence_of_puts_and_gets_returns_the_last_put_and_holds_the_budget(tmp_path_factory, ops, slots):
    folder = tmp_path_factory.mktemp("store")
    one = nbytes(_state(0))
    store = StateStore(folder, budget_bytes=slots * one if slots else None)
    last: dict[int, int] = {}
    for step, (op, c) in enumerate(ops):
        if op == "put":
            store.put(c, _state(1000 * c + step))
            last[c] = 1000 * c + step
        else:
            got = store.get(c)
            if c not in last:
                assert got is None
            else:
                assert all(torch.equal(got[k], v) for k, v in _state(last[c]).items())
        if slots:
            assert store.memory_bytes <= max(slots, 1) * one
        on_disk = {int(p.stem.split("_")[1]) for p in folder.glob("*.safetensors")}
        assert on_disk.isdisjoint(store._held) and on_disk | set(store._held) == set(last)  # each state once
