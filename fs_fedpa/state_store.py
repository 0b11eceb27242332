"""What every client keeps between its rounds, in host memory up to a budget and on disk beyond it. No FederatedScope.

A client's state is a flat ``name -> tensor`` mapping (its own factors, local tensors, merges, personal adapter,
fold; :func:`flatten` / :func:`unflatten`). :meth:`StateStore.put` keeps a CPU copy; when the copies held exceed the
budget, the least recently used clients are written to ``<folder>/client_<id>.safetensors`` (atomically: a temporary
file, then a rename) and dropped from memory; :meth:`StateStore.get` reads a spilled client back. A file is read only
if it is the regular file that was written: not a link, of the size written, naming its client and this store's run
in its metadata (so two clients' files swapped are refused), and holding exactly the tensors written. Nothing is
pickled.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import secrets
import stat
from collections import OrderedDict
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch
from torch import Tensor

SEP = "|"


class SpillError(ValueError):
    """A spilled client's file is missing, unreadable, or not what was written: that client's state is lost."""

    def __init__(self, client: int, path: Path, reason: str):
        super().__init__(f"client #{client}: its spilled state {path} {reason}")
        self.client, self.path, self.reason = client, path, reason


def flatten(parts: Mapping[str, Mapping[str, object]]) -> dict[str, Tensor]:
    """``{"factors": {name: (B, A)}, "local": {name: t}, ...}`` -> ``{"factors|name|0": B, "factors|name|1": A,
    "local|name": t, ...}``; a part that is None or empty contributes nothing."""
    flat = {}
    for part, values in parts.items():
        for name, value in (values or {}).items():
            if isinstance(value, tuple):
                for i, t in enumerate(value):
                    flat[f"{part}{SEP}{name}{SEP}{i}"] = t
            else:
                flat[f"{part}{SEP}{name}"] = value
    return flat


def unflatten(flat: Mapping[str, Tensor]) -> dict[str, dict[str, object]]:
    """Inverse of :func:`flatten` (pairs come back as tuples; absent parts are absent)."""
    parts: dict[str, dict[str, object]] = {}
    pairs: dict[tuple[str, str], dict[int, Tensor]] = {}
    for key, t in flat.items():
        part, rest = key.split(SEP, 1)
        name, sep, index = rest.rpartition(SEP)
        if sep and index.isdigit() and name:
            pairs.setdefault((part, name), {})[int(index)] = t
        else:
            parts.setdefault(part, {})[rest] = t
    for (part, name), items in pairs.items():
        parts.setdefault(part, {})[name] = tuple(items[i] for i in sorted(items))
    return parts


def nbytes(tensors: Mapping[str, Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors.values())


class StateStore:
    """Per-client states in host memory up to ``budget_bytes`` (None: no limit), the least recently used beyond it
    on disk under ``folder``. A client's state is held at most once: in memory or in one file."""

    def __init__(self, folder, budget_bytes: int | None = None):
        self.folder = Path(folder)
        self.budget = budget_bytes
        self._held: OrderedDict[int, dict[str, Tensor]] = OrderedDict()
        self._held_bytes = 0
        self._spilled: dict[int, Written] = {}  # what each file must be
        self.run = secrets.token_hex(8)  # this store's identity, in every file it writes
        self.spills = self.reads = 0  # counts, for the log and the benchmark
        self.initial_local: dict[str, Tensor] | None = None  # set by the owner: what a lost state restarts from
        self.peak_bytes = 0  # the most bytes held in memory at once
        self.reported = False

    def __contains__(self, client: int) -> bool:
        return client in self._held or client in self._spilled

    @property
    def memory_bytes(self) -> int:
        return self._held_bytes

    @property
    def disk_bytes(self) -> int:
        return sum(self._path(c).stat().st_size for c in self._spilled if self._path(c).is_file())

    def summary(self) -> str:
        budget = "no budget" if self.budget is None else f"budget {self.budget / 2**20:.3g} MiB"
        peak, disk = self.peak_bytes / 2**20, self.disk_bytes / 2**20
        where = f"peak {peak:.3g} MiB in memory ({budget}), {disk:.3g} MiB on disk now"
        return f"{self.spills} spills, {self.reads} reads back, {where}"

    def put(self, client: int, state: Mapping[str, Tensor]) -> None:
        """Keep a CPU copy of ``state`` as ``client``'s (replacing any), then spill beyond the budget."""
        self.drop(client)
        copy = {k: t.detach().to("cpu", copy=True).contiguous() for k, t in state.items()}
        self._held[client] = copy
        self._held_bytes += nbytes(copy)
        self._spill_beyond_budget(keep=client)
        self.peak_bytes = max(self.peak_bytes, self._held_bytes)

    def get(self, client: int) -> dict[str, Tensor] | None:
        """``client``'s state (CPU tensors the caller must not change in place), read back if it was spilled; None
        if it has none. Raises :class:`SpillError` if its file is not what was written (the state is then gone)."""
        if client in self._held:
            self._held.move_to_end(client)
            return self._held[client]
        if client not in self._spilled:
            return None
        expected = self._spilled.pop(client)
        path = self._path(client)
        state = _read(client, path, expected, self.run)
        path.unlink(missing_ok=True)
        self.reads += 1
        self._held[client] = state
        self._held_bytes += nbytes(state)
        self._spill_beyond_budget(keep=client)
        return state

    def drop(self, client: int) -> None:
        """Forget ``client``'s state (memory and file)."""
        if client in self._held:
            self._held_bytes -= nbytes(self._held.pop(client))
        if self._spilled.pop(client, None) is not None:
            self._path(client).unlink(missing_ok=True)

    def _path(self, client: int) -> Path:
        return self.folder / f"client_{client}.safetensors"

    def _spill_beyond_budget(self, keep: int) -> None:
        if self.budget is None:
            return
        while self._held_bytes > self.budget and len(self._held) > 1:
            client = next(iter(self._held))
            if client == keep:
                self._held.move_to_end(client)
                continue
            state = self._held.pop(client)
            self._held_bytes -= nbytes(state)
            self._write(client, state)

    def _write(self, client: int, state: dict[str, Tensor]) -> None:
        from safetensors.torch import save

        self.folder.mkdir(parents=True, exist_ok=True)
        path = self._path(client)
        tmp = path.with_suffix(".tmp")
        data = save(state, metadata={"client": str(client), "run": self.run})
        with open(tmp, "wb") as f:
            f.write(data)
        os.replace(tmp, path)
        shapes = {k: (tuple(t.shape), t.dtype) for k, t in state.items()}
        self._spilled[client] = Written(len(data), shapes, hashlib.blake2b(data).hexdigest())
        self.spills += 1


class Written(NamedTuple):
    """What a spilled file must be: its size in bytes, each tensor's shape and dtype, and the blake2b digest of its
    bytes (kept in memory only: a file edited in place at the same size is caught by it)."""

    size: int
    shapes: dict[str, tuple[tuple[int, ...], torch.dtype]]
    digest: str


def _read(client: int, path: Path, expected: Written, run: str) -> dict[str, Tensor]:
    """The tensors of ``client``'s spilled file, or :class:`SpillError` if it is not the file that was written. The
    file is opened without following a link or blocking, checked to be a regular file of the size written, then read
    whole into memory (never mapped: a file cut short while in use would kill the process) and parsed."""
    from safetensors.torch import load

    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    except FileNotFoundError:
        raise SpillError(client, path, "is missing") from None
    except OSError as exc:
        if errno.ELOOP == exc.errno:
            raise SpillError(
                client, path, f"is a link (to {os.readlink(path)!r}), not the file that was written"
            ) from None
        raise SpillError(client, path, f"cannot be opened ({exc})") from None
    with os.fdopen(fd, "rb") as f:
        info = os.fstat(f.fileno())
        if not stat.S_ISREG(info.st_mode):
            raise SpillError(client, path, "is not a regular file")
        if info.st_size != expected.size:
            raise SpillError(client, path, f"is {info.st_size} bytes, written as {expected.size}")
        data = f.read(expected.size + 1)
    if len(data) != expected.size:
        raise SpillError(client, path, f"changed while it was read ({len(data)} bytes, written as {expected.size})")
    try:
        n = int.from_bytes(data[:8], "little")
        owner = json.loads(data[8 : 8 + n]).get("__metadata__") or {}
        loaded = load(data)  # views of the read-only bytes: copied below into tensors of their own
    except Exception as exc:  # safetensors raises its own error types for a garbled file
        raise SpillError(client, path, f"cannot be read ({type(exc).__name__}: {str(exc)[:200]})") from None
    if not isinstance(owner, dict) or owner.get("client") != str(client) or owner.get("run") != run:
        who = f"client {owner.get('client')!r} of run {owner.get('run')!r}" if isinstance(owner, dict) else "no one"
        raise SpillError(client, path, f"was written for {who}, not for this client of this run")
    if set(loaded) != set(expected.shapes):
        raise SpillError(
            client, path, f"holds other tensors than were written ({len(loaded)} vs {len(expected.shapes)})"
        )
    for key, t in loaded.items():
        if (tuple(t.shape), t.dtype) != expected.shapes[key]:
            raise SpillError(
                client, path, f"holds {key} as {tuple(t.shape)} {t.dtype}, written as {expected.shapes[key]}"
            )
    if hashlib.blake2b(data).hexdigest() != expected.digest:  # same size, owner and shapes, other values
        raise SpillError(client, path, "holds other bytes than were written (its blake2b digest differs)")
    return {key: loaded[key].clone() for key in expected.shapes}  # writable, in the order they were put
