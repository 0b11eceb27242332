"""The random states of a process (torch, CUDA, numpy, random): taken, set, forked, and checked before a resume sets
them. No FederatedScope import.
"""

from __future__ import annotations

import random

import numpy as np
import torch
from torch import Tensor


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


def check_rng(rng, at: str, field: str) -> None:
    """ValueError naming ``field`` unless ``rng`` holds the torch, numpy and random states of a process (each set
    on a scratch generator of its kind: what the resume would set on the process's own)."""
    if not isinstance(rng, dict) or not {"torch", "numpy", "random"} <= rng.keys():
        raise ValueError(f"{at}: field {field!r} is not the RNG states (torch, numpy, random) of a process")
    for key in ("torch", "numpy", "random"):
        try:
            if key == "torch":
                check_generator_state(rng[key], at, f"{field}.torch")
            elif key == "numpy":
                name, keys, pos, has_gauss, cached = rng[key]
                np.random.RandomState().set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, cached))
            else:
                state = rng[key]
                random.Random().setstate((state[0], tuple(state[1]), state[2]))
        except ValueError as err:
            if str(err).startswith(at):
                raise
            raise ValueError(f"{at}: field '{field}.{key}' is not a {key} generator's state") from None
        except Exception:  # noqa: BLE001 (TypeError, OverflowError, IndexError: a malformed state of any shape)
            raise ValueError(f"{at}: field '{field}.{key}' is not a {key} generator's state") from None


def check_generator_state(state, at: str, field: str) -> None:
    """ValueError naming ``field`` unless ``state`` is a CPU torch generator's state (uint8, of its size)."""
    size = torch.Generator().get_state().numel()
    if not isinstance(state, Tensor) or state.dtype != torch.uint8 or tuple(state.shape) != (size,):
        shown = f"a {state.dtype} tensor of shape {tuple(state.shape)}" if isinstance(state, Tensor) else repr(state)
        raise ValueError(f"{at}: field {field!r} is {shown:.100}, not a torch generator's state (uint8, ({size},))")
    try:
        torch.Generator().set_state(state)
    except RuntimeError:
        raise ValueError(f"{at}: field {field!r} is not a torch generator's state") from None
