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


def _st(header: dict, data: bytes = b"", length: int | None = None) -> str:
    """Base64 of hand-made safetensors bytes: an 8-byte little-endian header length, the JSON header, the data."""
    text = json.dumps(header).encode()
    return base64.b64encode((length or len(text)).to_bytes(8, "little") + text + data).decode()


def _one(dtype="F32", shape=(2, 3), offsets=(0, 24), data=bytes(24), **more) -> str:
    return _st({"t": {"dtype": dtype, "shape": list(shape), "data_offsets": list(offsets)}, **more}, data)


@pytest.mark.parametrize(
    "value, reason",
    [
        ([[1.0, 2.0]], "got list"),
        (None, "got NoneType"),
        (3.5, "got float"),
        (b"AAAA", "got bytes"),
        ({"dtype": "float32", "shape": [2, 3], "data": "AAAA"}, "a mapping with keys"),  # the format of 07b6cca
        (_one(), None),  # the hand-made bytes are right: each case below changes one thing
        (_one("I64", offsets=(0, 48), data=bytes(48)), "encoded dtype 'int64'"),
        (_one("BOOL", offsets=(0, 6), data=bytes(6)), "encoded dtype 'bool'"),
        (_one("F8_E4M3", offsets=(0, 6), data=bytes(6)), "encoded dtype 'float8_e4m3fn'"),
        (_one(shape=[1] * 9, offsets=(0, 4), data=bytes(4)), "more than 8 dims"),
        (_one(shape=(2, -3)), "not safetensors"),
        (_one(shape=(2, 4)), "not safetensors"),  # the shape needs 32 bytes, 24 are sent
        (_one(shape=(10**12, 10**6)), "not safetensors"),  # refused before anything is allocated
        (_one(data=bytes(28)), "not safetensors"),  # bytes beyond the tensor
        (_one(data=bytes(20)), "not safetensors"),
        (_one(u={"dtype": "F32", "shape": [0], "data_offsets": [24, 24]}), "expected one named 't'"),
        (_st({"x": {"dtype": "F32", "shape": [1], "data_offsets": [0, 4]}}, bytes(4)), "expected one named 't'"),
        (_one(__metadata__={"pad": "x" * 400}), "longer than 320 bytes"),  # a hostile header, before it is parsed
        (_st({}, length=2**62), "longer than 320 bytes"),
        (_st({}, length=8), "not safetensors"),  # a header length beyond the bytes sent
        (base64.b64encode(b"1234").decode(), "cut short"),
        ("AAAA" * 10 + "!!!!", "not base64"),
        ("gASVAAAA", "cut short"),  # a pickle's first bytes
    ],
)
def test_malformed_encodings_are_refused_with_a_reason(value, reason):
    if reason is None:
        assert torch.equal(from_wire(value), torch.zeros(2, 3))
        return
    with pytest.raises(ValueError, match=reason.replace("[", r"\[")):
        from_wire(value)


def test_the_longest_honest_header_fits_and_the_text_is_bounded_before_decoding():
    # Prepare: the widest header a peer can claim, 8 dims of 19 digits (safetensors then refuses the size)
    widest = _one("BF16", [10**18] * 8, (0, 10**19), b"")
    honest = to_wire(torch.empty([2**63 - 1] + [0] * 7, dtype=torch.bfloat16))
    # Execute / Assert: both headers are within the bound, so safetensors reads them
    assert all(int.from_bytes(base64.b64decode(text)[:8], "little") <= 320 for text in (widest, honest))
    with pytest.raises(ValueError, match="not safetensors"):
        from_wire(widest)
    assert from_wire(honest).shape == (2**63 - 1,) + (0,) * 7
    # a text longer than max_chars, or than max_numel values can need, is refused by its length alone
    with pytest.raises(ValueError, match="encoded tensor of 40 characters, more than a factor can need [(]36[)]"):
        from_wire("!" * 40, what="a factor", max_chars=36)
    with pytest.raises(ValueError, match="more than it can need"):
        from_wire(to_wire(torch.ones(100)), max_numel=10)
    assert torch.equal(from_wire(to_wire(torch.ones(100)), max_numel=100), torch.ones(100))


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
    with pytest.raises(ValueError, match="more than"):  # an encoding's length, before its data is read
        decode_parts({"q|B": to_wire(torch.ones(1000, 1000))}, {"q": 12 * 10})
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
