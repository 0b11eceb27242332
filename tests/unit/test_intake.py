"""The server's intake of one client's upload (fs_fedpa.plugin.intake.check_upload): each fault of the table is
refused with its reason, before anything else reads the upload; tolerable variations are accepted as such."""

from __future__ import annotations

import base64

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fs_fedpa.plugin.intake import MAX_ABS, Accepted, check_upload, sample_size
from fs_fedpa.plugin.payload import encode_factors, to_wire
from tests.integration.fault_cases import HostileMapping  # torch and numpy only, no FS

SHAPES = {"q": (6, 5), "v": (6, 5)}
R = 2


def _factors(scale=1.0):
    g = torch.Generator().manual_seed(0)
    return {
        n: (scale * torch.randn(d, R, generator=g), torch.randn(R, k, generator=g)) for n, (d, k) in SHAPES.items()
    }


def _complete(parts):
    return {n: (p["B"], p["A"]) for n, p in parts.items()}


def _check(size, content, **kw):
    args = dict(expected_parts={"B", "A"}, complete=_complete, shapes=SHAPES, ranks=(R,), shared_shapes={})
    return check_upload(size, content, **{**args, **kw})


def _content(factors=None, wire=False, **extra):
    return {"lora": encode_factors(factors or _factors(), wire=wire), "stats": {"lam": 1.0}, **extra}


def _with(key, value, wire=False):
    c = _content(wire=wire)
    c["lora"][key] = value
    return c


def _stats(**stats):
    return {**_content(), "stats": stats}


class HostileFloat(float):
    def __float__(self):
        raise RuntimeError("a hostile __float__")


class SubTensor(torch.Tensor):
    pass


def _without(key):
    c = _content()
    del c["lora"][key]
    return c


F = _factors()


def _int64_encoding() -> str:
    """safetensors bytes of an int64 B, which :func:`to_wire` refuses to make."""
    from safetensors.torch import save

    return base64.b64encode(save({"t": torch.ones(6, R, dtype=torch.int64)})).decode()


# (case, sample size, content, the reason's words); every one must be dropped
FAULTS = [
    ("sample size a string", "12", _content(), "is not a number"),
    ("sample size None", None, _content(), "is not a number"),
    ("sample size a bool", True, _content(), "is not a number"),
    ("sample size NaN", float("nan"), _content(), "not a finite number"),
    ("sample size Inf", float("inf"), _content(), "not a finite number"),
    ("sample size < 0", -5, _content(), "not a finite number"),
    ("sample size 1e30", 1e30, _content(), "not a finite number"),
    ("sample size 10**400", 10**400, _content(), "overflows a float"),
    ("sample size complex", 3 + 1j, _content(), "is not a number"),
    ("sample size a tensor of 2", torch.tensor([1, 2]), _content(), "is not a number"),
    ("content None", 10, None, "payload of type NoneType"),
    ("content a tuple", 10, (1, 2), "payload of type tuple"),
    ("content a string", 10, "lora", "payload of type str"),
    ("no lora", 10, {"stats": {}}, "without a 'lora' mapping"),
    ("lora a list", 10, {"lora": [1, 2]}, "without a 'lora' mapping"),
    ("stats a list", 10, {**_content(), "stats": [1.0]}, "not a mapping"),
    ("stat a string", 10, {**_content(), "stats": {"lam": "1"}}, "is not a number"),
    ("stat 10**400", 10, {**_content(), "stats": {"num_train_data": 10**400}}, "overflows"),
    ("stat with a non-string key", 10, {**_content(), "stats": {3: 1.0}}, "is not a string"),
    ("factor a pickle string", 10, _with("q|B", "gASVAAAAAAAAAACMBXBvc2l4lIwGc3lzdGVtlJOULg=="), "header"),
    ("factor a list", 10, _with("q|B", F["q"][0].tolist()), "got list"),
    ("factor None", 10, _with("q|B", None), "got NoneType"),
    ("encoding with a wrong byte count", 10, _with("q|B", to_wire(F["q"][0])[:-8]), "not safetensors"),
    ("encoding of int64", 10, _with("q|B", _int64_encoding()), "encoded dtype 'int64'"),
    ("encoding of the old format", 10, _with("q|B", {"dtype": "float32", "shape": [6, 2]}), "got a mapping"),
    ("int tensor", 10, _with("q|B", torch.ones(6, R, dtype=torch.int64)), "dtype torch.int64"),
    ("bool tensor", 10, _with("q|B", torch.ones(6, R, dtype=torch.bool)), "dtype torch.bool"),
    ("complex tensor", 10, _with("q|B", torch.ones(6, R, dtype=torch.complex64)), "dtype torch.complex64"),
    ("sparse tensor", 10, _with("q|B", torch.ones(6, R).to_sparse()), "layout"),
    ("meta tensor", 10, _with("q|B", torch.empty(6, R, device="meta")), "meta tensor"),
    ("malformed key", 10, _with("qB", F["q"][0]), "malformed factor key"),
    ("unknown module", 10, {**_content(), "lora": {**_content()["lora"], "w|B": F["q"][0], "w|A": F["q"][1]}},
     "unknown LoRA modules"),
    ("missing module", 10, {"lora": encode_factors({"q": F["q"]})}, "missing from the upload"),
    ("B without its A", 10, _without("q|A"), "uploaded factors ['B']"),
    ("B of the wrong rank", 10, _with("q|B", torch.ones(6, R + 1)), "expected (6, 2)"),
    ("A of the wrong width", 10, _with("q|A", torch.ones(R, 4)), "expected (6, 2) and (2, 5)"),
    ("B a vector", 10, _with("q|B", torch.ones(6)), "expected (6, 2)"),
    ("NaN in B", 10, _with("q|B", torch.full((6, R), float("nan"))), "NaN or Inf in B"),
    ("Inf in A", 10, _with("q|A", torch.full((R, 5), float("inf"))), "NaN or Inf in A"),
    ("float64 beyond float32", 10, _with("q|B", torch.full((6, R), 1e300, dtype=torch.float64)), "NaN or Inf in B"),
    ("finite but 1e20", 10, _with("q|B", torch.full((6, R), 1e20)), f"> {MAX_ABS:g}"),
    ("B scaled by 1e7", 10, _content(_factors(1e7)), f"> {MAX_ABS:g}"),
    ("shared tensor unexpected", 10, {**_content(), "shared": {"head": torch.ones(2)}}, "differ from the expected"),
    ("shared tensor a string", 10, {**_content(), "shared": {"head": "x"}}, "head: encoded tensor is not base64"),
    # a weight (FlexLoRA's num_train_data) is bounded like the sample size, naming the field
    ("num_train_data 10**30", 10, _stats(num_train_data=10**30),
     "num_train_data(=1e+30) must be an integer in [0, 1e+15]"),
    ("num_train_data 1e30", 10, _stats(num_train_data=1e30), "num_train_data(=1e+30) must be an integer"),
    ("num_train_data < 0", 10, _stats(num_train_data=-5), "num_train_data(=-5) must be an integer"),
    ("num_train_data 12.5", 10, _stats(num_train_data=12.5), "num_train_data(=12.5) must be an integer"),
    ("num_train_data NaN", 10, _stats(num_train_data=float("nan")), "num_train_data(=nan) must be an integer"),
    ("num_train_data a string", 10, _stats(num_train_data="12"), "num_train_data = '12' (str) is not a number"),
    # hostile Python objects (standalone mode hands them over): refused by type, never called
    ("sample size a hostile float", HostileFloat(3.0), _content(), "sample size cannot be read as a number"),
    ("stat a hostile float", 10, _stats(lam=HostileFloat(1.0)), "stat 'lam' cannot be read as a number"),
    ("content a hostile mapping", 10, HostileMapping(_content()), "payload of type HostileMapping is not a dict"),
    ("lora a hostile mapping", 10, {**_content(), "lora": HostileMapping(_content()["lora"])},
     "'lora' of type HostileMapping is not a dict"),
    ("stats a hostile mapping", 10, {**_content(), "stats": HostileMapping({})}, "not a mapping of names to numbers"),
    ("factor expanded to 10**12 entries", 10, _with("q|B", torch.zeros(1).expand(10**6, 10**6)),
     "more than a factor of its module can hold (30)"),
    ("factor an expanded view", 10, _with("q|B", torch.zeros(1, 1).expand(6, R)), "repeats the 4 bytes it holds"),
    ("encoding larger than its module", 10, _with("q|B", to_wire(torch.ones(10, 10))), "more than a factor of"),
    ("shared tensor larger than expected", 10, {**_content(), "shared": {"head": torch.zeros(1).expand(10**9)}},
     "more than the shared tensor can hold (30)"),
    ("factor a numpy array", 10, _with("q|B", np.ones((6, R), dtype=np.float32)), "got ndarray"),
    ("factor a tensor subclass", 10, _with("q|B", F["q"][0].as_subclass(SubTensor)), "got SubTensor"),
]  # fmt: skip


@pytest.mark.parametrize("case, size, content, reason", FAULTS, ids=[f[0] for f in FAULTS])
def test_each_fault_is_refused_with_its_reason(case, size, content, reason):
    result = _check(size, content)
    assert isinstance(result, str), f"{case} was accepted"
    assert reason in result, result


@pytest.mark.parametrize(
    "case, size, content",
    [
        ("plain", 10, _content()),
        ("encoded", 10, _content(wire=True)),
        ("numpy int sample size", np.int64(10), _content()),
        ("numpy float sample size", np.float32(10.0), _content()),
        ("0-d tensor sample size", torch.tensor(10), _content()),
        ("float64 factors", 10, {"lora": encode_factors({n: (B.double(), A.double()) for n, (B, A) in F.items()})}),
        ("bfloat16 factors, encoded", 10, {"lora": encode_factors({n: (B.bfloat16(), A) for n, (B, A) in F.items()},
                                                                   wire=True)}),
    ],
)  # fmt: skip
def test_tolerable_variations_are_accepted_in_the_servers_dtype(case, size, content):
    result = _check(size, content)
    assert isinstance(result, Accepted), result
    assert result.size == 10.0
    for name, (B, A) in result.factors.items():
        assert B.dtype == A.dtype == torch.float32
        torch.testing.assert_close(B, F[name][0], atol=0.02, rtol=0.01)  # bfloat16 keeps ~3 digits
        torch.testing.assert_close(A, F[name][1])


def test_the_accepted_tensors_are_copies():
    content = _content()
    result = _check(10, content)
    result.factors["q"][0].add_(1)
    assert torch.equal(content["lora"]["q|B"], F["q"][0])


def test_sample_sizes_by_hand():
    assert sample_size(3) == 3.0 and sample_size(np.float64(2.5)) == 2.5 and sample_size(0) == 0.0
    assert isinstance(sample_size(float("nan")), str) and isinstance(sample_size("3"), str)


def test_weight_cap_and_norm_outliers_by_hand():
    from fs_fedpa.aggregation import cap_weights, norm_outliers

    assert cap_weights([10, 12, 1e14], 2.0) == [10, 12, 24.0]  # median 12
    assert cap_weights([10, 12, 1e14], 0.0) == [10, 12, 1e14]  # off: the paper's weights
    assert norm_outliers([1.0, 1.2, 0.9, 15.0], 10.0) == [3]  # median 1.1
    assert norm_outliers([1.0, 1e9], 10.0) == []  # two uploads have no meaningful median
    assert norm_outliers([1.0, 2.0, 3.0], 0.0) == []


@given(st.integers(0, 2**31), st.integers(1, 3))
def test_update_norm_is_the_norm_of_the_dense_products(seed, r):
    from fs_fedpa.aggregation import update_norm

    g = torch.Generator().manual_seed(seed)
    factors = {n: (torch.randn(7, r, generator=g), torch.randn(r, 4, generator=g)) for n in ("q", "v")}
    dense = sum(float(torch.linalg.matrix_norm(B.double() @ A.double())) ** 2 for B, A in factors.values()) ** 0.5
    assert update_norm(factors) == pytest.approx(dense, rel=1e-5)


def test_a_split_that_evaluated_no_example_is_missing_not_zero():
    from fs_fedpa.plugin.common import without_empty_splits

    metrics = {
        "val_acc": 0.0, "val_loss": 0.0, "val_total": 0,
        "local.val_acc": 0.0, "local.val_total": 0,
        "test_acc": 0.75, "test_total": 8, "local.test_acc": 0.5, "local.test_total": 8,
    }  # fmt: skip
    kept, empty = without_empty_splits(metrics)
    assert empty == ["local.val", "val"]
    assert kept == {"test_acc": 0.75, "test_total": 8, "local.test_acc": 0.5, "local.test_total": 8}


def test_an_upload_the_method_cannot_complete_is_refused_with_the_methods_reason():
    def refuse(parts):
        raise ValueError("client #2 trains the 2 modules [0, 3] in round 5")

    assert _check(10, _content(), complete=refuse) == "client #2 trains the 2 modules [0, 3] in round 5"
    assert isinstance(_check(10, _content()), Accepted)


def test_a_non_finite_diagnostic_is_kept_as_none_and_the_upload_accepted():
    # Prepare: what an honest client reports when its task gradient is 0 or its drift overflows
    stats = {"lam": 1.0, "grad_ratio_first": float("inf"), "drift": float("nan"), "delta_norm": 10**400}
    # Execute
    result = _check(10, _stats(**stats, num_train_data=np.int64(7)))
    # Assert
    assert isinstance(result, Accepted), result
    assert result.stats == {
        "lam": 1.0,
        "grad_ratio_first": None,
        "drift": None,
        "delta_norm": None,
        "num_train_data": 7,
    }
    assert type(result.stats["num_train_data"]) is int


class Trap(dict):
    """A dict whose own methods raise: the intake must read it through dict's methods, and get its contents."""

    def _trap(self, *args, **kwargs):
        raise RuntimeError("a method of the sender's dict ran")

    get = items = keys = values = __iter__ = __getitem__ = __len__ = __contains__ = _trap


def test_dict_subclasses_are_read_through_dicts_own_methods_and_give_their_true_contents():
    content = _content()
    trapped = Trap({"lora": Trap(content["lora"]), "stats": Trap(content["stats"])})
    result = _check(10, trapped)
    assert isinstance(result, Accepted), result
    assert all(torch.equal(result.factors[n][0], F[n][0]) and torch.equal(result.factors[n][1], F[n][1]) for n in F)
    assert result.stats == {"lam": 1.0}


def test_zero_weights_take_no_part_in_the_cap():
    from fs_fedpa.aggregation import cap_weights

    assert cap_weights([0.0, 0.0, 16.0], 2.0) == [0.0, 0.0, 16.0]  # the median of all three (0) capped 16 to 0
    assert cap_weights([0.0, 10.0, 12.0, 1e14], 2.0) == [0.0, 10.0, 12.0, 24.0]  # median of the positive: 12
    assert cap_weights([0.0, 0.0], 2.0) == [0.0, 0.0]  # no positive weight: unchanged (the server weighs equally)


def test_message_content_that_no_code_may_walk_is_named():
    from fs_fedpa.plugin.intake import check_message_content, message_pair

    honest = (10, {**_content(), "shared": {"head": torch.ones(2)}})
    assert check_message_content(honest) is None
    assert check_message_content([np.int64(10), _content(wire=True)]) is None  # numpy scalars, encodings
    assert message_pair(honest) == honest
    for content, words in (
        (_content(), "is not a (sample size, payload) pair"),
        ((1, 2, 3), "is not a (sample size, payload) pair"),
        ((10, _with("q|B", np.broadcast_to(np.zeros(1), (10**6, 10**6)))), "content[1]['lora']['q|B'] is a ndarray"),
        ((10, _with("q|B", torch.zeros(1).expand(10**6, 10**6))), "over 4 bytes (an expanded view)"),
        ((HostileFloat(1.0), _content()), "content[0] is a HostileFloat"),
        ((10, HostileMapping(_content())), "content[1] is a HostileMapping"),
        ((10, {"lora": {(1, 2): torch.ones(1)}}), "has a key of type tuple"),
        ((10, {"x": [[[[[[[[[1]]]]]]]]]}), "nested deeper than 8"),
    ):
        assert words in (check_message_content(content) or ""), (content, words)
    assert message_pair(_content()) == "message content of type dict is not a (sample size, payload) pair"


def test_an_encoded_factor_longer_than_its_module_needs_is_refused_without_decoding(monkeypatch):
    """Issue 88: one signed upload carrying 150 MB of base64 in B was decoded for 22 s, past the round timeout. The
    bound on a factor was the module's d x k values at any rank, so a B claiming shape (d, k) in float64 was decoded
    before its rank was checked. Now B may hold d x r values (A r x k) at the ranks the client uploads, and the text
    is measured against that before its shape is read or anything is decoded: the decoder is never called."""
    # Prepare: the base64 decoder fails if called; B holds (d, k) in float64, and a B of 1.5 MB
    from fs_fedpa.plugin import payload

    def decoder(*args, **kwargs):
        raise AssertionError("the base64 decoder was called")

    shapes = {**SHAPES, "q": (64, 48)}  # d (k - r) float64 values beyond the header's bound of 320 bytes
    full = to_wire(torch.zeros(shapes["q"], dtype=torch.float64))
    long = "A" * 1_500_000
    monkeypatch.setattr(payload.base64, "b64decode", decoder)
    # Execute / Assert
    for value in (full, long):
        reason = _check(5, _with("q|B", value, wire=True), shapes=shapes)
        assert isinstance(reason, str) and reason.startswith("undecodable payload (q|B:") and "more than" in reason
