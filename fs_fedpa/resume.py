"""Resume points of a FedPA run: what the server and each client keep, written where and read back when.

FS's ``federate.restore_from`` reloads only the global model and restarts at round 0. With ``federate.save_to``
set, the plugin writes a *resume point* whenever a round starts (after round ``t - 1`` was aggregated, before
clients are sampled for round ``t``):

- the server's file ``fedpa_resume_<save_to name>``: a head (the round ``t``, the method, its rank plan and
  settings, the process's RNG states taken at that moment: torch, CUDA, numpy, random) and one ``state_dict()``
  per collaborator of the server (:data:`PARTS`: the global model, the round log, the aggregator, FS's result
  history, the DP policy and the method), the server model's state under FS's own ``model`` key;
- each client's file ``<server file>.client<id>.r<round>``, written when it finishes a round: its own factors,
  local tensors, rounds trained and its process's RNG states (the last two rounds are kept, so a run killed
  half-way through a round still finds each client's state for the round the server file names).

``federate.restore_from: <server file>`` then resumes at round ``t``: the server restores its part, and each
client restores the newest of its files older than the first round it is sent. Evaluation runs under
``torch.random.fork_rng``, so the random stream of training does not depend on when evaluations happened.

Every file is checked before it is used, and refused with a ``ValueError`` naming the file and the field. This
module checks the envelope: a server point's version, head and which parts it has (:func:`check_server_fields`), a
client file's owner (:func:`client_owner`: client id, ranks r_i and R_i, the run's method and result settings), which
must match the client that reads it (:func:`check_client_file`). Each part is checked by its owner (its
``check_state``, with the helpers of :mod:`fs_fedpa.state_checks`), every part before any is loaded. The round
history is not in a point: it is the run's diagnostics file, which the round log's part names by its size and
SHA-256.
"""

from __future__ import annotations

import errno
import io
import os
import re
import secrets
import stat
from pathlib import Path

import numpy as np
import torch
from torch import Tensor

from fs_fedpa.files import memory_bound, read_regular

# the random states are their own module; resume points and their users reach them through this one
from fs_fedpa.rng_states import check_generator_state, check_rng, fork_rng, rng_state, set_rng_state  # noqa: F401
from fs_fedpa.state_checks import check_int, check_mapping, is_int

PREFIX = "fedpa_resume_"
# a server resume point's ``fedpa_resume``: its head, checked first, and one ``state_dict()`` per collaborator of the
# server, each checked by its own ``check_state`` (every part before any ``load_state_dict``); ``settings`` and
# ``privacy`` are what the accountant's past depends on: a point without them is refused, not trusted
HEAD_FIELDS = ("version", "method", "round", "plan", "settings", "rng", "client_files")
PARTS = (
    "global_model",  # plugin.global_model.GlobalModel (its FS model: "model")
    "round_log",  # plugin.record_fs.RoundLog: the byte totals, the clients so far, the diagnostics file's digest
    "aggregator",  # plugin.aggregator.FedPAAggregator
    "fs_results",  # FS's own result history (plugin.resume_fs.FSResults)
    "privacy",  # the server's DP policy (fs_fedpa.privacy)
    "method_state",  # the method's (methods.base.FederatedMethod.state_dict)
    "run_report",  # run_summary.RunReport: the evaluations so far, the peak memory and the wall seconds
)
SERVER_FIELDS = (*HEAD_FIELDS, *PARTS)
# 2: the method's own state (``method_state``: HetLoRA's pruned ranks reset on resume before it) and this field;
# 3: one state dict per collaborator (PARTS) instead of fields picked out of them; 4: ``client_files`` (each client
# file's ``file_id``), the ledger's size and SHA-256, and each client file's ``data`` (issue 88); 5: no round history
# (the round log's part names the diagnostics file by its size and SHA-256), and the client files' factors are
# applied, ``(s_i B_i, A_i)``, and say so (``space``) (issue 89); 6: ``run_report``, what summary.json continues
# from (issue 90)
VERSION = 6
# whose a client file is; ``file_id``: the token of the client's files in this run (a resumed client keeps it),
# which the server's resume point records (another run's files, same settings or not, have another); ``data``: the
# client's training set (``n``: size)
OWNER_FIELDS = ("client", "rank", "reference_rank", "run", "file_id", "data")
_DISK_FULL = {errno.ENOSPC, getattr(errno, "EDQUOT", errno.ENOSPC)}


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
    """Write atomically: a run killed while saving, or a disk that fills up, leaves the previous file intact. A full
    disk raises ``OSError(ENOSPC)`` naming ``path`` (torch's own writer would only say that a write failed)."""
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    tmp = f"{path}.tmp"
    try:
        with open(tmp, "wb") as f:  # a Python file: torch's writes to it raise OSError with the errno
            torch.save(obj, f)
            f.flush()
            os.fsync(f.fileno())
    except BaseException as err:
        try:
            os.remove(tmp)  # a partial file would only take more of the space that is missing
        except OSError:
            pass
        if isinstance(err, OSError) and err.errno in _DISK_FULL:
            raise OSError(
                err.errno,
                f"the disk is full: cannot write the resume file {path} ({err.strerror}); the earlier resume files "
                "are intact: free space and resume from them",
            ) from None
        raise
    os.replace(tmp, path)


def file_bound(numel: int, records: int = 0) -> int:
    """A size no resume file of a model with ``numel`` elements (its factors, local tensors, base offsets and
    merges, at most 8 bytes an element, a few times over) and ``records`` entries of FS's result history can exceed."""
    return 32 * int(numel) + 64 * 2**10 * int(records) + 64 * 2**20


def load(path: str | Path, limit: int | None = None) -> dict:
    """A resume file: tensors, numbers, strings and containers only (``weights_only=True``: no pickled object of a
    planted file can run code), read only if it is a regular file of at most ``limit`` bytes (default
    :func:`memory_bound`; :func:`read_regular`). ``ValueError`` naming the file for anything else, a truncated file
    included."""
    data = read_regular(path, memory_bound() if limit is None else limit, f"the resume file {path}")
    try:
        saved = torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
    except Exception as err:  # UnpicklingError (a refused object), RuntimeError / EOFError (truncated), ...
        raise ValueError(
            f"{path} cannot be read as a resume file ({type(err).__name__}: {str(err).splitlines()[0][:200]}); "
            "resume files hold only tensors, numbers and strings"
        ) from None
    if not isinstance(saved, dict):
        raise ValueError(f"{path} is not a resume file (it holds a {type(saved).__name__}, not a dict)")
    return saved


def peek(path: Path, key: str, limit: int):
    """Field ``key`` of the resume file ``path``, read without its tensors' data (mapped, never touched); None for a
    file that is not a regular one of at most ``limit`` bytes, cannot be read, or has no such field. For a look at a
    file this run wrote (a client file's ``file_id``) or is about to restore: the restore reads the whole file."""
    try:
        info = os.stat(path)
        if not stat.S_ISREG(info.st_mode) or info.st_size > limit:
            return None
        saved = torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except Exception:  # noqa: BLE001 (unreadable: seen as no field; the restore's full read names the error)
        return None
    return saved.get(key) if isinstance(saved, dict) else None


def new_file_id() -> str:
    """The token of a client's files in one run (:data:`OWNER_FIELDS`)."""
    return secrets.token_hex(8)


def newest_files(resume: str) -> dict[int, tuple[int, Path]]:
    """``client -> (round, path)`` of each client's newest file beside ``resume``, in one scan of the folder."""
    path = Path(resume)
    pattern = re.compile(re.escape(f"{path.name}.client") + r"(\d+)\.r(\d+)$")
    found: dict[int, tuple[int, Path]] = {}
    for p in path.parent.iterdir() if path.parent.is_dir() else []:
        if match := pattern.match(p.name):
            client, rnd = int(match.group(1)), int(match.group(2))
            if rnd >= found.get(client, (-1, None))[0]:
                found[client] = (rnd, p)
    return found


# ---------------------------------------------------------------------------------------------- checks
def result_settings(cfg, method) -> dict:
    """The keys that change a run's result: compared when it resumes, and part of every client file's owner."""
    c = method.cfg
    return {
        "fedpa.lam": c.lam, "fedpa.reg": c.reg, "fedpa.svd": c.svd, "fedpa.oversample": c.oversample,
        "fedpa.adaptive_lam": c.adaptive_lam, "seed": cfg.seed, "fedpa.seed": c.seed,
        "train.optimizer.lr": float(cfg.train.optimizer.lr), "fedpa.base_quantization": c.base_quantization,
    }  # fmt: skip


def client_owner(cfg, method, client: int) -> dict:
    """Whose a client file is: the client id, its ranks r_i and R_i in the rank plan, and the run (its method and
    :func:`result_settings`), as the client writes them and every restore compares them."""
    return {
        "client": client,
        "rank": method.plan.client_ranks[client - 1],
        "reference_rank": method.plan.reference_ranks[client - 1],
        "run": {"method": method.name, "settings": result_settings(cfg, method)},
    }


def check_client_file(saved: dict, path, rnd: int, *, cfg, method, client: int, data: dict | None = None) -> None:
    """ValueError naming ``path`` and the field unless the envelope of ``saved`` is client ``client``'s after round
    ``rnd`` (the round of its name) in this run: the owner's fields equal :func:`client_owner`, ``file_id`` is a
    string, ``data`` the client's training set (``n``), as it is now where the caller knows it (the client itself),
    ``round`` is ``rnd`` and ``rng`` a process's RNG states. The client's state in it is its owner's to check
    (:meth:`fs_fedpa.plugin.client_state.ClientState.check_state`)."""
    at = f"resume file {path}"
    owner = client_owner(cfg, method, client)
    for key in OWNER_FIELDS:
        if key not in saved:
            raise ValueError(
                f"{at} has no field {key!r}: it predates the check of whose a resume file is (client id, ranks, run), "
                "so it cannot be told from another client's or another run's file; start the run again"
            )
    if not is_int(saved["client"]) or saved["client"] != client:
        raise ValueError(f"{at}: field 'client' is {saved['client']!r}, but the file is client {client}'s (its name)")
    for key, what in (("rank", "r_i"), ("reference_rank", "R_i")):
        if not is_int(saved[key]) or saved[key] != owner[key]:
            raise ValueError(
                f"{at}: field {key!r} is {saved[key]!r}, but this run's rank plan gives client {client} "
                f"{what}={owner[key]}"
            )
    run, now = saved["run"], owner["run"]
    then = run.get("settings") if isinstance(run, dict) else None
    if not isinstance(run, dict) or run.get("method") != now["method"] or not isinstance(then, dict):
        raise ValueError(f"{at}: field 'run' is {run!r:.300}; this run is method {now['method']!r}")
    if changed := sorted(k for k in now.keys() | then.keys() if then.get(k) != now["settings"].get(k)):
        diffs = ", ".join(f"{k}: saved {then.get(k)!r}, now {now['settings'].get(k)!r}" for k in changed)
        raise ValueError(f"{at}: field 'run' names a run with other settings ({diffs})")
    if not isinstance(saved["file_id"], str):
        raise ValueError(f"{at}: field 'file_id' is {saved['file_id']!r:.100}, not a client file's token")
    check_data(saved["data"], at, data)
    check_int(saved, at, "round", 0)
    if saved["round"] != rnd:
        raise ValueError(f"{at}: field 'round' is {saved['round']}, but the file's name says round {rnd}")
    check_rng(saved.get("rng"), at, "rng")


def check_data(saved, at: str, now: dict | None) -> None:
    """The ``data`` field of a client file: ``{"n": its training set size}``, equal to ``now`` where given. A client
    whose data changed since its file was written is not the one whose past steps (and DP ledger) the run counts."""
    if not isinstance(saved, dict) or not is_int(saved.get("n")) or saved["n"] < 0:
        raise ValueError(f"{at}: field 'data' is {saved!r:.100}, not a training set's size ({{'n': records}})")
    if now is not None and saved["n"] != now["n"]:
        raise ValueError(
            f"{at}: field 'data.n' is {saved['n']}, but the client's training set now has {now['n']} records: its "
            "data changed since the resume point, which the run's past (its DP accounting included) was counted on; "
            "resume with the data it had, or start the run again"
        )


def check_server_fields(saved: dict, path) -> None:
    """ValueError naming ``path`` and the field if the envelope of a server resume point is not this version's: its
    head (:data:`HEAD_FIELDS`) missing or malformed, or a part (:data:`PARTS`) missing or not a mapping. Each part's
    fields are its owner's to check (their ``check_state``)."""
    at = f"federate.restore_from {path!r}"
    if saved.get("version") != VERSION:
        why = {4: " (it carries the whole round history; the diagnostics file is the history now)",
               5: " (it has no run report: the resumed run's summary.json would lose the evaluations before it)",
               }.get(saved.get("version"), "")  # fmt: skip
        raise ValueError(
            f"{at} is a resume point of version {saved.get('version', 1)!r}{why}; this fs_fedpa reads version "
            f"{VERSION} only: continue that run with the fs_fedpa that wrote it, or start it again"
        )
    for key in SERVER_FIELDS:
        if key not in saved:
            raise ValueError(f"{at} has no field {key!r}; it is not a whole FedPA resume point")
    check_int(saved, at, "round", 0)
    for key, kind in (("method", str), ("plan", (list, tuple)), ("settings", dict)):
        if not isinstance(saved[key], kind) or key == "plan" and len(saved[key]) != 3:
            raise ValueError(f"{at}: field {key!r} is malformed ({saved[key]!r:.200})")
    for part in PARTS:
        check_mapping(saved[part], at, part)
    check_rng(saved["rng"], at, "rng")
    files = saved["client_files"]
    if not isinstance(files, dict) or not all(
        isinstance(c, int) and isinstance(v, (list, tuple)) and len(v) == 2 and is_int(v[0]) and
        isinstance(v[1], str) for c, v in files.items()):  # fmt: skip
        raise ValueError(f"{at}: field 'client_files' is not a mapping of clients to (round, file_id)")


def check_checkpoint(checkpoint: dict, path) -> None:
    """FS's own keys of a resume point (``cur_round``, ``model``: a mapping of names to tensors), which FS's loader
    reads before the plugin's: ValueError naming the file and the field."""
    at = f"federate.restore_from {path!r}"
    if not is_int(checkpoint.get("cur_round")):
        raise ValueError(f"{at}: field 'cur_round' is {checkpoint.get('cur_round', 'missing')!r:.100}, not an int")
    model = checkpoint.get("model")
    if not isinstance(model, dict) or not all(isinstance(k, str) and isinstance(v, Tensor) for k, v in model.items()):
        what = "missing" if "model" not in checkpoint else f"a {type(model).__name__}"
        raise ValueError(f"{at}: field 'model' is {what}, not FS's model state (names to tensors)")
