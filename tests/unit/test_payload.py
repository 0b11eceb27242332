"""The tensor-only wire format of the plugin's payloads (fs_fedpa.plugin.payload) and the weights-only resume
reader: what a peer or a file sends is decoded into tensors, or refused with a reason, and never unpickled."""

from __future__ import annotations

import base64
import json
import pickle

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fs_fedpa import resume
from fs_fedpa.plugin.payload import (
    WIRE_DTYPES,
    decode_factors,
    decode_merge,
    decode_parts,
    decode_tensors,
    encode_factors,
    encode_merge,
    from_wire,
    nbytes,
    to_wire,
)


class Canary:
    """Unpickling this calls ``open(path, "w")``: the file appears if anyone unpickles it."""

    def __init__(self, path):
        self.path = str(path)

    def __reduce__(self):
        return open, (self.path, "w")


def _bits(t: torch.Tensor) -> bytes:
    return t.contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()


@given(
    st.sampled_from(sorted(WIRE_DTYPES)),
    st.lists(st.integers(0, 5), min_size=0, max_size=3),
    st.integers(0, 2**31),
)
def test_every_float_dtype_and_shape_survives_json_bit_for_bit(dtype, shape, seed):
    g = torch.Generator().manual_seed(seed)
    t = (torch.randn(shape, generator=g) * 1e3).to(WIRE_DTYPES[dtype])
    if t.numel():
        t.view(-1)[0] = float("nan")  # special values travel as bits
    back = from_wire(json.loads(json.dumps(to_wire(t))))  # JSON stands for any transport of strings and ints
    assert back.dtype == t.dtype and back.shape == t.shape and _bits(back) == _bits(t)


def test_factors_round_trip_as_objects_and_encoded():
    B, A = torch.randn(6, 2), torch.randn(2, 5)
    for wire in (False, True):
        decoded = decode_factors(encode_factors({"q": (B, A)}, wire=wire))
        assert torch.equal(decoded["q"][0], B) and torch.equal(decoded["q"][1], A)
        assert decoded["q"][0] is not B  # a copy: nobody can alter what was sent
        assert nbytes({"lora": encode_factors({"q": (B, A)}, wire=wire)}) == 4 * (12 + 10)
    assert list(decode_parts(encode_factors({"q": (B, A)}, parts=("A",), wire=True))["q"]) == ["A"]


def test_a_pickled_upload_is_refused_without_being_unpickled(tmp_path):
    planted = tmp_path / "pwned"
    bomb = base64.b64encode(pickle.dumps(Canary(planted))).decode()
    pickle.loads(base64.b64decode(bomb)).close()  # the canary works: unpickling it creates the file
    assert planted.exists()
    planted.unlink()
    for flat in ({"q|B": bomb, "q|A": bomb}, {"q|B": {"dtype": "float32", "shape": [1], "data": bomb}}):
        with pytest.raises(ValueError, match="q[|]B"):
            decode_parts(flat)
    with pytest.raises(ValueError, match="head"):
        decode_tensors({"head": bomb})
    assert not planted.exists()


GOOD = to_wire(torch.ones(2, 3))


@pytest.mark.parametrize(
    "value, reason",
    [
        ("gASVAAAA", "got str"),
        ([[1.0, 2.0]], "got list"),
        (None, "got NoneType"),
        (3.5, "got float"),
        ({"dtype": "float32", "shape": [2, 3]}, "keys"),
        ({**GOOD, "extra": 1}, "keys"),
        ({**GOOD, "dtype": "int64"}, "encoded dtype 'int64'"),
        ({**GOOD, "dtype": "object"}, "encoded dtype 'object'"),
        ({**GOOD, "dtype": ["float32"]}, "encoded dtype"),
        ({**GOOD, "shape": [2, -3]}, "encoded shape"),
        ({**GOOD, "shape": [True, 3]}, "encoded shape"),
        ({**GOOD, "shape": [2.0, 3]}, "encoded shape"),
        ({**GOOD, "shape": [1] * 9}, "encoded shape"),
        ({**GOOD, "shape": "2,3"}, "encoded shape"),
        ({**GOOD, "shape": [2, 4]}, "does not hold shape"),
        ({**GOOD, "shape": [10**12, 10**6]}, "does not hold shape"),  # refused before anything is allocated
        ({**GOOD, "data": GOOD["data"][:-4]}, "does not hold shape"),
        ({**GOOD, "data": "!" * len(GOOD["data"])}, "not base64"),
        ({**GOOD, "data": 12}, "not base64 text"),
    ],
)
def test_malformed_encodings_are_refused_with_a_reason(value, reason):
    with pytest.raises(ValueError, match=reason.replace("[", r"\[")):
        from_wire(value)


def test_malformed_payload_structure_is_refused():
    with pytest.raises(ValueError, match="mapping"):
        decode_parts([("q|B", GOOD)])
    with pytest.raises(ValueError, match="malformed factor key"):
        decode_parts({"qB": GOOD})
    with pytest.raises(ValueError, match="malformed factor key"):
        decode_parts({3: GOOD})
    assert nbytes(None) == 0 and nbytes(("lora",)) == 0 and nbytes({"lora": None}) == 0


def test_a_planted_resume_file_is_refused_and_runs_nothing(tmp_path):
    planted, path = tmp_path / "pwned", tmp_path / "fedpa_resume_x"
    torch.save({"fedpa_resume": Canary(planted)}, path)
    torch.load(path, weights_only=False)["fedpa_resume"].close()  # the canary works when unpickled
    assert planted.exists()
    planted.unlink()
    with pytest.raises(ValueError, match="cannot be read as a resume file"):
        resume.load(path)
    assert not planted.exists()


def test_a_truncated_resume_file_is_refused_with_its_name(tmp_path):
    path = tmp_path / "fedpa_resume_y"
    resume.save(
        {"round": 3, "global": {"q": (torch.ones(2, 1), torch.ones(1, 2))}, "rng": resume.rng_state()}, str(path)
    )
    assert resume.load(path)["round"] == 3  # what the plugin writes loads weights-only
    path.write_bytes(path.read_bytes()[:100])
    with pytest.raises(ValueError, match="fedpa_resume_y cannot be read"):
        resume.load(path)


@pytest.mark.parametrize("wire", [False, True])
def test_merges_travel_as_factors_or_as_their_dense_products_in_order_and_cost_what_they_carry(wire):
    g = torch.Generator().manual_seed(0)
    merges = [{"q": (torch.randn(12, r, generator=g), torch.randn(r, 10, generator=g))} for r in (5, 3)]
    dense_merges = [{"q": B @ A} for B, A in (m["q"] for m in merges)]
    for travelling, count in ((merges, 8 * (12 + 10)), (dense_merges, 2 * 12 * 10)):
        flat = encode_merge(travelling, wire)
        assert nbytes({"base": flat}) == 4 * count
        decoded = decode_merge(flat)
        assert len(decoded) == 2
        for got, (B, A) in zip(decoded, (m["q"] for m in merges)):
            torch.testing.assert_close(got["q"], B @ A)
    assert decode_merge({}) == []
    for bad in ({"q|B": torch.zeros(2, 2)}, {"x|q": torch.zeros(2)}, ["0|q"]):
        with pytest.raises(ValueError, match="merge"):
            decode_merge(bad)


class Trap(dict):
    """A dict whose every own method raises: code that reads it through dict's methods gets its true contents."""

    def _trap(self, *args, **kwargs):
        raise RuntimeError("a method of the sender's dict ran")

    get = items = keys = values = __iter__ = __getitem__ = __len__ = __contains__ = _trap


def test_a_tensor_expanded_to_10_to_the_12_is_refused_before_it_is_copied_or_counted():
    # Prepare: 10^12 entries over 4 bytes; a copy would need 4 TB
    huge = torch.zeros(1).expand(10**6, 10**6)
    # Execute / Assert: refused by the module's size, and, without a size, as a view repeating its storage
    with pytest.raises(
        ValueError, match=r"q\|B: a tensor of shape \(1000000, 1000000\) \(1000000000000 values\), more"
    ):
        decode_parts({"q|B": huge}, {"q": 12 * 10})
    with pytest.raises(ValueError, match="repeats the 4 bytes it holds"):
        decode_parts({"q|B": huge})
    with pytest.raises(ValueError, match="more than the shared tensor can hold"):
        decode_tensors({"head": huge}, {"head": 4})
    with pytest.raises(ValueError, match="more than"):  # an encoding's claimed shape, before its data is read
        decode_parts({"q|B": {**GOOD, "shape": [1000, 1000]}}, {"q": 12 * 10})
    assert nbytes({"lora": {"q|B": huge}}) == 4  # what the tensor holds, not the 4 TB its shape claims


def test_a_tensor_within_its_modules_size_is_decoded_as_before():
    B = torch.randn(12, 5)
    assert torch.equal(decode_parts({"q|B": B}, {"q": 12 * 10})["q"]["B"], B)
    assert torch.equal(decode_parts({"q|B": to_wire(B)}, {"q": 60})["q"]["B"], B)  # exactly the limit


def test_hostile_python_objects_are_refused_by_type_without_calling_them():
    class Sub(torch.Tensor):
        pass

    for value, reason in (
        (np.ones((2, 3), dtype=np.float32), "got ndarray"),
        (np.broadcast_to(np.zeros(1, dtype=np.float32), (10**6, 10**6)), "got ndarray"),
        (torch.ones(2, 3).as_subclass(Sub), "got Sub"),
    ):
        with pytest.raises(ValueError, match=reason):
            decode_parts({"q|B": value})
    with pytest.raises(ValueError, match="a mapping with keys"):  # a dict subclass is read through dict's methods
        decode_parts({"q|B": Trap(dtype="float32")})


def test_a_dict_subclass_is_read_through_dicts_own_methods_only():
    # Prepare: the payload of an honest upload inside dicts whose own methods raise
    B, A = torch.randn(12, 2), torch.randn(2, 10)
    plain = {"lora": encode_factors({"q": (B, A)})}
    trapped = Trap({"lora": Trap(plain["lora"])})
    # Execute
    decoded = decode_parts(Trap(plain["lora"]))
    # Assert
    assert torch.equal(decoded["q"]["B"], B) and torch.equal(decoded["q"]["A"], A)
    assert nbytes(trapped) == nbytes(plain) == 4 * (24 + 20)
