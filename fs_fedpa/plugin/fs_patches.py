"""Every place where fs_fedpa patches or hooks FederatedScope, in one file: what it replaces, where FS defines it,
and why. Everything else the plugin does goes through FS's registry and handler overrides on its worker classes.

The targets are those of FS's ``llm`` branch at commit 7f08694 (``../shared/vendor/FederatedScope-llm-7f08694.tar.gz``);
:data:`SEAMS` names each one's file and line there, and ``tests/unit/test_fs_patches.py`` fails when an installed FS
defines one elsewhere or with another signature, so an FS upgrade shows where to look before a run goes wrong.
"""

from __future__ import annotations

import sys
import weakref
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

FS_COMMIT = "7f08694"


@dataclass(frozen=True)
class Seam:
    """An FS definition the plugin patches or looks up: its dotted ``target`` (module:qualified name), the file and
    line of its ``def`` in FS at :data:`FS_COMMIT`, that line, and what the plugin does there."""

    target: str
    file: str
    line: int
    signature: str
    use: str


SEAMS = (
    Seam("federatedscope.core.message:Message.count_bytes", "federatedscope/core/message.py", 255,
         "def count_bytes(self):",
         "replaced once per process (guard_count_bytes): FS's standalone runner sizes every message with pympler "
         "before any handler, and one client's message could stop the run"),
    Seam("federatedscope.core.communication:gRPCCommManager.receive", "federatedscope/core/communication.py", 208,
         "def receive(self):",
         "wrapped on the server (authentication and field checks before FS parses) and on the client (the "
         "watchdog's clock), distributed mode only"),
    Seam("federatedscope.core.communication:StandaloneCommManager.send", "federatedscope/core/communication.py", 47,
         "def send(self, message):",
         "wrapped on every client: what it sends is checked (and signed, distributed)"),
    Seam("federatedscope.core.communication:gRPCCommManager.send", "federatedscope/core/communication.py", 194,
         "def send(self, message):",
         "as StandaloneCommManager.send, in distributed mode"),
    Seam("federatedscope.core.workers.server:gRPCCommManager", "federatedscope/core/communication.py", 103,
         "class gRPCCommManager(object):",
         "the name FS's Server.__init__ builds its distributed comm manager by: bound to the plugin's "
         "TLSCommManager while the plugin's server is built with fedpa.net.tls_cert (grpc_comm_manager)"),
    Seam("federatedscope.core.workers.client:gRPCCommManager", "federatedscope/core/communication.py", 103,
         "class gRPCCommManager(object):", "as for the server, in FS's Client.__init__"),
    Seam("federatedscope.core.communication:gRPCCommManager.__init__", "federatedscope/core/communication.py", 108,
         "def __init__(self, host='0.0.0.0', port='50050', client_num=2, cfg=None):",
         "subclassed by TLSCommManager (fs_fedpa/plugin/tls_fs.py), which takes these arguments and the TLS files"),
    Seam("federatedscope.core.communication:gRPCCommManager.serve", "federatedscope/core/communication.py", 133,
         "def serve(self, max_workers, host, port, options):",
         "overridden by TLSCommManager: a TLS port requiring a client certificate, and a servicer that records it"),
    Seam("federatedscope.core.communication:gRPCCommManager._send", "federatedscope/core/communication.py", 172,
         "def _send(self, receiver_address, message):",
         "overridden by TLSCommManager (its send goes over TLS to each receiver's certificate instead)"),
    Seam("federatedscope.core.gRPC_server:gRPCComServeFunc.sendMessage", "federatedscope/core/gRPC_server.py", 12,
         "def sendMessage(self, request, context):",
         "extended by TLSServeFunc: the sender's certificate name is written into the request it queues"),
    Seam("federatedscope.core.monitors.monitor:Monitor.finish_fed_runner", "federatedscope/core/monitors/monitor.py",
         294, "def finish_fed_runner(self, fl_mode=None):",
         "wrapped on the server in standalone mode, whose runner never calls Server.run: the end-of-run checks and "
         "the run's (epsilon, delta) line"),
    Seam("federatedscope.core.workers.client:Client.__init__", "federatedscope/core/workers/client.py", 56,
         "def __init__(self,",
         "its module's pickle is a shim while a client is built (sized_once): FS sizes the client's model with "
         "sys.getsizeof(pickle.dumps(model)), read only to simulate a link's time, and with share_local_model that "
         "pickled the one shared model again for every client, 0.16 s each (most of setting up 2,000 clients)"),
    Seam("federatedscope.core.trainers.torch_trainer:GeneralTorchTrainer._hook_on_batch_forward",
         "federatedscope/core/trainers/torch_trainer.py", 286, "def _hook_on_batch_forward(self, ctx):",
         "found by name among the trainer's train hooks and replaced by DP-SGD's per-example forward"),
    Seam("federatedscope.core.trainers.torch_trainer:GeneralTorchTrainer._hook_on_batch_backward",
         "federatedscope/core/trainers/torch_trainer.py", 380, "def _hook_on_batch_backward(self, ctx):",
         "found by name and replaced by DP-SGD's clipped, noised step"),
    Seam("federatedscope.llm.trainer.trainer:LLMTrainer._hook_on_batch_forward",
         "federatedscope/llm/trainer/trainer.py", 63, "def _hook_on_batch_forward(self, ctx):",
         "FS-LLM's own, found by the same name under DP-SGD"),
    Seam("federatedscope.llm.trainer.trainer:LLMTrainer._hook_on_batch_backward",
         "federatedscope/llm/trainer/trainer.py", 94, "def _hook_on_batch_backward(self, ctx):",
         "FS-LLM's own, found by the same name under DP-SGD"),
    Seam("federatedscope.core.auxiliaries.aggregator_builder:get_aggregator",
         "federatedscope/core/auxiliaries/aggregator_builder.py", 7,
         "def get_aggregator(method, model=None, device=None, online=False, config=None):",
         "its 'not implemented' notice is filtered out of its logger while the plugin's server is built "
         "(no_aggregator_notice): the plugin's server replaces the aggregator FS builds there"),
    Seam("federatedscope.core.trainers.context:Context._calculate_batch_epoch_num",
         "federatedscope/core/trainers/context.py", 224, "def _calculate_batch_epoch_num(self, mode='train'):",
         "its 'cur_mode ... mismatch' warning, repeated at every evaluation of every client, is shown once per "
         "process of a plugin run (warn_once)"),
    Seam("federatedscope.core.configs.config:CN.clear_aux_info", "federatedscope/core/configs/config.py", 60,
         "def clear_aux_info(self):",
         "extended on the fedpa node only (extend_clear_aux_info): FS calls it on the copy of the config it dumps "
         "to a run's config.yaml (and to wandb), and the node's old flat keys are left out of that copy"),
    Seam("federatedscope.core.configs.config:CN.merge_from_list", "federatedscope/core/configs/config.py", 130,
         "def merge_from_list(self, cfg_list, check_cfg=True):",
         "extended on the root config only (extend_merges): the keys a command line names and their raw values are "
         "seen before FS coerces them (a float for an int key is truncated there), and kept as the keys given"),
    Seam("federatedscope.core.configs.config:CN.merge_from_other_cfg", "federatedscope/core/configs/config.py", 115,
         "def merge_from_other_cfg(self, cfg_other, check_cfg=True):",
         "as merge_from_list, for a yaml (merge_from_file calls it) or another config"),
)  # fmt: skip

_GUARD = "fedpa_guard"  # marks FS's Message.count_bytes once replaced


def guard_count_bytes(make: Callable[[Callable], Callable]) -> None:
    """Replace ``Message.count_bytes`` by ``make(original)``, once per process (later calls change nothing)."""
    from federatedscope.core.message import Message

    if getattr(Message.count_bytes, _GUARD, False):
        return
    replacement = make(Message.count_bytes)
    setattr(replacement, _GUARD, True)
    Message.count_bytes = replacement


def wrap_receive(comm_manager, make: Callable[[Callable], Callable]) -> None:
    """``comm_manager.receive`` becomes ``make(its current receive)``, on this instance only."""
    comm_manager.receive = make(comm_manager.receive)


def wrap_send(comm_manager, make: Callable[[Callable], Callable]) -> Callable:
    """``comm_manager.send`` becomes ``make(its current send)``, on this instance only; returns the transport."""
    transport = comm_manager.send
    comm_manager.send = make(transport)
    return transport


@contextmanager
def grpc_comm_manager(make: Callable | None) -> Iterator[None]:
    """Within: FS's ``Server.__init__`` and ``Client.__init__`` build their distributed comm manager with
    ``make(host=, port=, client_num=, cfg=)`` in place of FS's ``gRPCCommManager`` (None: FS's own, untouched)."""
    if make is None:
        yield
        return
    from federatedscope.core.workers import client as fs_client
    from federatedscope.core.workers import server as fs_server

    originals = [(module, module.gRPCCommManager) for module in (fs_server, fs_client)]
    for module, _ in originals:
        module.gRPCCommManager = make
    try:
        yield
    finally:
        for module, original in originals:
            module.gRPCCommManager = original


def extend_clear_aux_info(node, after: Callable) -> None:
    """On this config node only (and its clones: a deep copy binds the method to the copy), FS's
    ``clear_aux_info`` is followed by ``after(node)``. A node's own method, in its instance ``__dict__``, since FS's
    merges require every node to be exactly FS's CN (yacs compares the types); a pickled copy (FS's spawned
    processes) unpickles with FS's method alone."""
    import types

    def clear_aux_info(self):
        type(self).clear_aux_info(self)
        after(self)

    node.__dict__["clear_aux_info"] = types.MethodType(clear_aux_info, node)


def extend_merges(root, before: Callable) -> None:
    """On the root config ``root`` only (and its clones, as :func:`extend_clear_aux_info`), FS's ``merge_from_list``
    and ``merge_from_other_cfg`` (which ``merge_from_file`` calls) first call ``before(root, pairs, other)``, ``pairs``
    the ``(dotted key, value as given)`` of every key and section about to be merged, before FS decodes and coerces
    them, and ``other`` the config merged (None for a list)."""
    import types

    def merge_from_list(self, cfg_list, check_cfg=True):
        before(self, list(zip(cfg_list[0::2], cfg_list[1::2])), None)
        return type(self).merge_from_list(self, cfg_list, check_cfg)

    def merge_from_other_cfg(self, cfg_other, check_cfg=True):
        before(self, list(_given(cfg_other, "")), cfg_other)
        return type(self).merge_from_other_cfg(self, cfg_other, check_cfg)

    root.__dict__["merge_from_list"] = types.MethodType(merge_from_list, root)
    root.__dict__["merge_from_other_cfg"] = types.MethodType(merge_from_other_cfg, root)


def _given(node, prefix: str) -> Iterator[tuple[str, object]]:
    """``(dotted key, value)`` of every section and key of a mapping ``node``, depth first."""
    for key, value in node.items():
        yield f"{prefix}{key}", value
        if isinstance(value, dict):
            yield from _given(value, f"{prefix}{key}.")


def wrap_finish(monitor, make: Callable[[Callable], Callable]) -> None:
    """``monitor.finish_fed_runner`` becomes ``make(its current one)``, on this instance only."""
    monitor.finish_fed_runner = make(monitor.finish_fed_runner)


def train_hook(trainer, trigger: str, name: str) -> Callable:
    """The one hook named ``name`` (FS's ``_hook_on_batch_forward``, ``_hook_on_batch_backward``) among ``trainer``'s
    train hooks at ``trigger``; ValueError naming the trainer where there is not exactly one."""
    hooks = [h for h in trainer.hooks_in_train[trigger] if getattr(h, "__name__", "") == name]
    if len(hooks) != 1:
        raise ValueError(f"trainer {type(trainer).__name__} has {len(hooks)} {name} train hooks at {trigger}, not 1")
    return hooks[0]


# model -> sys.getsizeof of its pickle, or the exception pickling it raised (FS then sizes it 1.0 and warns)
_PICKLE_SIZES: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


class _Sized:
    """Stands for a pickle where FS only reads ``sys.getsizeof`` of it: that is ``size``."""

    __slots__ = ("_inner",)

    def __init__(self, size: int):
        self._inner = 0
        self._inner = size - sys.getsizeof(self)  # getsizeof adds the object's header to __sizeof__

    def __sizeof__(self) -> int:
        return self._inner


class _SizingPickle:
    """FS's client module's ``pickle`` while a client is built: ``dumps(model)`` pickles ``model`` once per process
    and returns a stand-in of its size; anything else goes to the real module."""

    def __init__(self, real, model):
        self._real, self._model = real, model

    def dumps(self, obj, *args, **kwargs):
        if self._model is None or obj is not self._model:
            return self._real.dumps(obj, *args, **kwargs)
        if obj not in _PICKLE_SIZES:
            try:
                _PICKLE_SIZES[obj] = sys.getsizeof(self._real.dumps(obj, *args, **kwargs))
            except Exception as error:  # e.g. a lambda in the model: FS catches it, per client
                _PICKLE_SIZES[obj] = error
        found = _PICKLE_SIZES[obj]
        if isinstance(found, Exception):
            raise found
        return _Sized(found)

    def __getattr__(self, name):
        return getattr(self._real, name)


@contextmanager
def sized_once(model) -> Iterator[None]:
    """Within: FS's ``Client.__init__`` sizes ``model`` from one pickle of it per process instead of pickling it for
    every client (the same ``model_size``; a client with a model of its own is sized as before)."""
    from federatedscope.core.workers import client as fs_client

    real = fs_client.pickle
    fs_client.pickle = _SizingPickle(real, model)
    try:
        yield
    finally:
        fs_client.pickle = real


@contextmanager
def no_aggregator_notice() -> Iterator[None]:
    """Within: FS's ``get_aggregator`` does not log "Aggregator for method <m> is not implemented. Will use default
    one", which FS's ``Server.__init__`` prints for every plugin method before the plugin's server replaces that
    aggregator with its own (a correct run should not read as a misconfigured one)."""
    import logging

    def keep(record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith("Aggregator for method")

    fs_logger = logging.getLogger("federatedscope.core.auxiliaries.aggregator_builder")
    fs_logger.addFilter(keep)
    try:
        yield
    finally:
        fs_logger.removeFilter(keep)


class _OncePerMessage:
    """A logging filter: each distinct message of its logger once, marked so; its repeats are counted, not shown."""

    def __init__(self):
        self.seen: dict[str, int] = {}

    def filter(self, record) -> bool:
        text = record.getMessage()
        self.seen[text] = self.seen.get(text, 0) + 1
        if self.seen[text] == 1:
            record.msg, record.args = f"{text} (shown once; its repeats are not)", ()
            return True
        return False


def warn_once(name: str = "federatedscope.core.trainers.context") -> None:
    """Within this process, FS's logger ``name`` says each message once: its trainer context warns that
    ``cur_mode test mismatch mode val`` at every evaluation of every client (60 lines in the tiny run)."""
    import logging

    fs_logger = logging.getLogger(name)
    if not any(isinstance(f, _OncePerMessage) for f in fs_logger.filters):
        fs_logger.addFilter(_OncePerMessage())
