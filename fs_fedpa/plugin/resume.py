"""Resume points of a FedPA run: what the server and each client keep, written where and read back when.

FS's ``federate.restore_from`` reloads only the global model and restarts at round 0. With ``federate.save_to``
set, the plugin writes a *resume point* whenever a round starts (after round ``t - 1`` was aggregated, before
clients are sampled for round ``t``):

- the server's file ``fedpa_resume_<save_to name>``: the round ``t``, the global factors, the server model's
  state, the sketch generator, the bytes and diagnostics so far, FS's result history and the process's RNG
  states (torch, CUDA, numpy, random) taken at that moment;
- each client's file ``<server file>.client<id>.r<round>``, written when it finishes a round: its own factors,
  local tensors, rounds trained and its process's RNG states (the last two rounds are kept, so a run killed
  half-way through a round still finds each client's state for the round the server file names).

``federate.restore_from: <server file>`` then resumes at round ``t``: the server restores its part, and each
client restores the newest of its files older than the first round it is sent. Evaluation runs under
``torch.random.fork_rng``, so the random stream of training does not depend on when evaluations happened.
"""

from __future__ import annotations

import os
import random
import re
from pathlib import Path

import numpy as np
import torch

PREFIX = "fedpa_resume_"


def server_path(save_to: str) -> str:
    """``dir/name`` -> ``dir/fedpa_resume_name``."""
    head, tail = os.path.split(save_to)
    return os.path.join(head, PREFIX + tail)


def client_path(resume: str, client: int, rnd: int) -> str:
    return f"{resume}.client{client}.r{rnd}"


def client_files(resume: str, client: int) -> dict[int, Path]:
    """``round -> path`` of the client's files beside ``resume``."""
    path = Path(resume)
    pattern = re.compile(re.escape(f"{path.name}.client{client}.r") + r"(\d+)$")
    found = {}
    for p in path.parent.glob(f"{path.name}.client{client}.r*") if path.parent.is_dir() else []:
        if match := pattern.match(p.name):
            found[int(match.group(1))] = p
    return found


def rng_state() -> dict:
    """The process's generator states, in types ``torch.load(weights_only=True)`` accepts (FS loads our files)."""
    name, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch": torch.get_rng_state(),
        "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(cached)],
        "random": random.getstate(),
    }
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    torch.set_rng_state(state["torch"])
    name, keys, pos, has_gauss, cached = state["numpy"]
    np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
    random.setstate(state["random"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])


def fork_rng():
    """A context in which random draws do not advance the process's generators (CPU and current CUDA device)."""
    devices = [torch.cuda.current_device()] if torch.cuda.is_available() else []
    return torch.random.fork_rng(devices=devices)


def plain(value):
    """``value`` with numpy scalars and arrays made Python numbers and lists (for weights-only loading)."""
    if isinstance(value, dict):
        return {k: plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return type(value)(plain(v) for v in value)
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


def save(obj: dict, path: str) -> None:
    """Write atomically: a run killed while saving leaves the previous file intact."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    torch.save(obj, tmp)
    os.replace(tmp, path)


def load(path: str | Path) -> dict:
    """A resume file: tensors, numbers, strings and containers only (``weights_only=True``: no pickled object of a
    planted file can run code). ``ValueError`` naming the file for anything else, a truncated file included."""
    try:
        saved = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError (a refused object), RuntimeError / EOFError (truncated), ...
        raise ValueError(
            f"{path} cannot be read as a resume file ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
            "resume files hold only tensors, numbers and strings"
        ) from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} is not a resume file (it holds a {type(saved).__name__}, not a dict)")
    return saved
