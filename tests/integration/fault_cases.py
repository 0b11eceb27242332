"""The fault table of the FS-run intake test (test_faults_fs.py) and of docs/errors.md: each entry changes what one
client sends in one round, ``(sample_size, upload) -> (sample_size, content)``, and names the words of the reason
the server must log. Used inside the probe's subprocess (fs_probe.py), so everything here is built from the real
upload it is given. Kept in step with the table of docs/errors.md by a test."""

from __future__ import annotations

import base64
import os
import pickle
from collections.abc import Mapping

import numpy as np
import torch


def _b_key(upload: dict) -> str:
    return sorted(k for k in upload["lora"] if k.endswith("|B"))[0]


def _a_key(upload: dict) -> str:
    return sorted(k for k in upload["lora"] if k.endswith("|A"))[0]


def _set(upload: dict, key: str, value) -> dict:
    return {**upload, "lora": {**upload["lora"], key: value}}


def _on_b(fn):
    return lambda n, u: (n, _set(u, _b_key(u), fn(u["lora"][_b_key(u)])))


def _on_a(fn):
    return lambda n, u: (n, _set(u, _a_key(u), fn(u["lora"][_a_key(u)])))


def _stats(value):
    return lambda n, u: (n, {**u, "stats": value})


def _size(value):
    return lambda n, u: (value, u)


def _nan(t):
    t = t.clone()
    t[0, 0] = float("nan")
    return t


def _stat(key: str, value):
    return lambda n, u: (n, {**u, "stats": {**u.get("stats", {}), key: value}})


class HostileFloat(float):
    """A float whose conversion to float raises: whoever calls ``float()`` on it crashes unless it catches."""

    def __float__(self):
        raise RuntimeError("a hostile __float__")


class HostileMapping(Mapping):
    """A read-only view of a dict whose ``get``, ``items``, ``keys`` and ``values`` raise (only the abstract methods
    work): whoever calls them crashes unless it catches."""

    def __init__(self, inner: dict):
        self._inner = inner

    def __getitem__(self, key):
        return self._inner[key]

    def __iter__(self):
        return iter(self._inner)

    def __len__(self):
        return len(self._inner)

    def _trap(self, *args):
        raise RuntimeError("a hostile mapping method")

    get = items = keys = values = _trap


def _numpy_broadcast(t):
    """A numpy array of 10**12 entries over 4 bytes (FS's pympler byte counter raises on it)."""
    return np.broadcast_to(np.zeros(1, dtype=np.float32), (10**6, 10**6))


class Canary:
    """Unpickling this calls ``open(path, "w")``, so the file exists afterwards if anyone unpickled it."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return open, (self.path, "w")


def _encoded(t: torch.Tensor) -> str:
    """A tensor's wire text of any dtype (the plugin's to_wire refuses int64)."""
    from safetensors.torch import save

    return base64.b64encode(save({"t": t.contiguous()})).decode()


def _pickled(_t):
    return base64.b64encode(pickle.dumps(Canary(os.environ.get("FS_PROBE_CANARY", os.devnull)))).decode()


def _drop_key(key_of):
    def fn(n, u):
        lora = dict(u["lora"])
        del lora[key_of(u)]
        return n, {**u, "lora": lora}

    return fn


def _unknown_module(n, u):
    return n, {
        **u,
        "lora": {**u["lora"], "no.such.module|B": u["lora"][_b_key(u)], "no.such.module|A": u["lora"][_a_key(u)]},
    }


def _missing_module(n, u):
    module = _b_key(u).rsplit("|", 1)[0]
    return n, {**u, "lora": {k: v for k, v in u["lora"].items() if not k.startswith(module + "|")}}


# name -> (what the client sends instead, words of the logged reason); every case is dropped
FAULTS = {
    "sample size a string": (_size("12"), "is not a number"),
    "sample size None": (_size(None), "is not a number"),
    "sample size NaN": (_size(float("nan")), "not a finite number"),
    "sample size < 0": (_size(-5), "not a finite number"),
    "sample size 1e30": (_size(1e30), "not a finite number"),
    "sample size 10**400": (_size(10**400), "overflows a float"),
    "content None": (lambda n, u: (n, None), "payload of type NoneType"),
    "content a tuple": (lambda n, u: (n, (1, 2)), "payload of type tuple"),
    "content a string": (lambda n, u: (n, "lora"), "payload of type str"),
    "content without lora": (lambda n, u: (n, {"stats": {}}), "without a 'lora' mapping"),
    "stats a list": (_stats([1.0]), "not a mapping"),
    "stat a string": (_stats({"lam": "1"}), "is not a number"),
    "stat 10**400": (_stats({"num_train_data": 10**400}), "overflows"),
    "pickle": (_on_b(_pickled), "safetensors header"),
    "factor a list": (_on_b(lambda t: t.tolist()), "got list"),
    "factor None": (_on_b(lambda t: None), "got NoneType"),
    "int tensor": (_on_b(lambda t: t.to(torch.int64)), "dtype torch.int64"),
    "complex tensor": (_on_b(lambda t: t.to(torch.complex64)), "dtype torch.complex64"),
    "sparse tensor": (_on_b(lambda t: t.to_sparse()), "layout"),
    "meta tensor": (_on_b(lambda t: torch.empty(t.shape, device="meta")), "meta tensor"),
    "unknown module": (_unknown_module, "unknown LoRA modules"),
    "missing module": (_missing_module, "missing from the upload"),
    "B without its A": (_drop_key(_a_key), "uploaded factors ['B']"),
    "shape": (_on_a(lambda t: torch.cat([t, t[:1]])), "expected"),
    "B a vector": (_on_b(lambda t: t[:, 0].clone()), "expected"),
    "nan": (_on_b(_nan), "NaN or Inf in B"),
    "Inf in A": (_on_a(lambda t: torch.full_like(t, float("inf"))), "NaN or Inf in A"),
    "float64 beyond float32": (_on_b(lambda t: torch.full(t.shape, 1e300, dtype=torch.float64)), "NaN or Inf in B"),
    "finite but 1e20": (_on_b(lambda t: torch.full_like(t, 1e20)), "> 1e+06"),
    "B scaled by 1e7": (_on_b(lambda t: t * 1e7 + 1e7), "> 1e+06"),
    "malformed key": (lambda n, u: (n, {**u, "lora": {"noseparator": u["lora"][_b_key(u)]}}), "malformed factor key"),
    "encoding of int64": (_on_b(lambda t: _encoded(t.to(torch.int64))), "encoded dtype"),
    "encoding with a wrong byte count": (_on_b(lambda t: _encoded(t)[:-8]), "not safetensors"),
    "encoding not base64": (_on_b(lambda t: "!!!!!!!!"), "not base64"),
    "shared tensor that the run does not have": (
        lambda n, u: (n, {**u, "shared": {"lm_head.weight": torch.ones(2)}}),
        "differ from the expected",
    ),
    "stats with a non-string key": (_stats({3: 1.0}), "is not a string"),
    "sample size a bool": (_size(True), "is not a number"),
    "sample size Inf": (_size(float("inf")), "not a finite number"),
    "bool tensor": (_on_b(lambda t: t > 0), "dtype torch.bool"),
    "float16 overflow": (_on_b(lambda t: torch.full(t.shape, 1e5).to(torch.float16)), "NaN or Inf in B"),
    "message content a 3-tuple": (lambda n, u: (n, u, u), "is not a (sample size, payload) pair"),
    "sample size a float whose __float__ raises": (_size(HostileFloat(3.0)), "sample size cannot be read as a number"),
    "stat a float whose __float__ raises": (_stats({"lam": HostileFloat(1.0)}), "cannot be read as a number"),
    "content a mapping whose methods raise": (lambda n, u: (n, HostileMapping(u)), "payload of type HostileMapping"),
    "lora a mapping whose methods raise": (
        lambda n, u: (n, {**u, "lora": HostileMapping(u["lora"])}),
        "is not a dict",
    ),
    "factor expanded to 10**12 entries": (_on_b(lambda t: t[:1, :1].expand(10**6, 10**6)), "more than a factor of"),
    "factor a numpy array of 10**12 entries": (_on_b(_numpy_broadcast), "got ndarray"),
    "num_train_data 10**30": (
        _stat("num_train_data", 10**30),
        "num_train_data(=1e+30) must be an integer in [0, 1e+15]",
    ),
    "num_train_data < 0": (_stat("num_train_data", -5), "num_train_data(=-5) must be an integer"),
    "num_train_data 12.5": (_stat("num_train_data", 12.5), "num_train_data(=12.5) must be an integer"),
    "num_train_data NaN": (_stat("num_train_data", float("nan")), "num_train_data(=nan) must be an integer"),
}


# Poisoning that passes every check, and what the opt-in bounds of docs/errors.md do about it
POISONING = {
    "B scaled by 1e4": _on_b(lambda t: t * 1e4),
    "sample size 1e14": _size(1e14),
    "sample size 0": _size(0),  # legal: a client that trained on nothing, weight 0
    # every entry of every factor at 9.9e5, just below the 1e6 bound: legal, and huge
    "every entry 9.9e5": lambda n, u: (n, {**u, "lora": {k: torch.full_like(t, 9.9e5) for k, t in u["lora"].items()}}),
    # a diagnostic that overflowed on the client (a float32 norm past 3.4e38): legal, recorded as null
    "gradient ratio overflowed": _stat("grad_ratio_first", float("inf")),
}


def corrupt(name: str, size, upload: dict):
    """What a client whose fault is ``name`` sends instead of ``(size, upload)``."""
    return (POISONING[name] if name in POISONING else FAULTS[name][0])(size, upload)
