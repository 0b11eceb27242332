"""What comes in to the server, checked and authenticated, before FS's own code reads it.

The path of a client's update: gRPC request -> :meth:`ServerInbox._receive_checked` (FS's fields parsed one by
one, the signature checked with ``fedpa.net.auth_keyring``, every field checked by
:func:`fs_fedpa.plugin.messages.message_problem`) -> :meth:`ServerInbox.callback_funcs_model_para` (only the
round's receivers, once each) -> FS's message buffer -> :class:`fs_fedpa.plugin.aggregator.FedPAAggregator`
(each upload checked by :func:`fs_fedpa.plugin.intake.check_upload`). In standalone mode the first hook is FS's
byte counter (:func:`guard_fs_byte_count`)."""

from __future__ import annotations

import logging
import time

from federatedscope.core.message import Message

from fs_fedpa.plugin import auth, fs_patches, tls_fs
from fs_fedpa.plugin.common import send
from fs_fedpa.plugin.intake import check_message_content
from fs_fedpa.plugin.liveness import TIMEOUT
from fs_fedpa.plugin.messages import ServerView, message_problem
from fs_fedpa.plugin.payload import shown
from fs_fedpa.record import EVAL_SECONDS

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only


class ServerInbox:
    """Mixin of :class:`~fs_fedpa.plugin.server.FedPAServer` (needs ``_keyring``, ``_expected``, ``_progress``)."""

    def _install_inbox(self) -> None:
        """The inbox's checks, installed by the server when it is built: FS's byte counter guarded (the standalone
        runner sizes each message before any handler), and in distributed mode every message from the network
        passes :meth:`_receive_checked` before FS reads it, whatever loop (FS's ``run`` or an override) receives."""
        guard_fs_byte_count()
        if self._cfg.federate.mode.lower() == "distributed":
            fs_patches.wrap_receive(self.comm_manager, lambda _: self._receive_checked)

    def _receive_checked(self) -> Message:
        """The next message from the network that passes every check of :mod:`fs_fedpa.plugin.messages` (and, with
        ``fedpa.net.auth_keyring``, carries its sender's signature); every other one is dropped, naming its claimed
        sender and the field that failed, before FS's own code reads it."""
        while True:
            raw = self.comm_manager.server_funcs.receive()
            message, problem = _parsed(raw)
            if problem is None and message.msg_type == TIMEOUT and message.content == self._token:
                return message
            problem = problem or self._message_problem(message, tls_fs.peer_of(raw))
            if problem is None:
                return message
            sender = message.sender if isinstance(message.sender, int) else str(message.sender)[:40]
            logger.warning(f"[fedpa] round {self.state}: ignored a message from client {sender}: {problem}")

    def _message_problem(self, message: Message, peer: str | None = None) -> str | None:
        """Why ``message`` must be dropped, or None; with a keyring, also unwraps the signed content and, for a
        join, sets the sender to the id its key is registered for; over TLS, the sender must be the client of the
        certificate ``peer`` it came over, which a join takes as its id."""
        joined = frozenset(self.comm_manager.neighbors)
        monitor = getattr(getattr(self, "_monitor", None), "metric_calculator", None)
        metrics = frozenset(getattr(monitor, "eval_metric", None) or ())
        view = ServerView(self.state, self.total_round_num, self.client_num, joined, metrics)
        fields = (message.msg_type, message.sender, message.state, message.timestamp)
        if self._keyring:
            if message.msg_type == "join_in" and message.sender == -1:
                candidates = [c for c in self._keyring if c not in joined]
            elif isinstance(message.sender, int) and message.sender in self._keyring:
                candidates = [message.sender]
            else:
                candidates = []
            reason = "no key of this run is registered for it"
            if message.msg_type == "join_in" and message.sender == -1 and not candidates:
                reason = f"a join, but all {self.client_num} clients joined already"
            for cid in candidates:
                content, reason = auth.verify(self._keyring[cid], *fields, message.content)
                if reason is None:
                    message.content = content
                    if message.msg_type == "join_in":
                        message.sender = cid  # the id of its key, not the order of joining
                    break
            if reason is not None:
                return f"{message.msg_type!s:.40} message: {reason}"
        elif isinstance(message.content, dict) and set(message.content) == {auth.SIGNED, auth.MAC}:
            return "a signed message, but this server has no fedpa.net.auth_keyring to check it with"
        if self._tls and (reason := tls_fs.sender_problem(message, peer, joined)) is not None:
            return f"{message.msg_type!s:.40} message: {reason}"
        problem = message_problem(
            message.msg_type, message.sender, message.state, message.timestamp, message.content, view
        )
        if problem is None and message.msg_type == "model_para" and message.timestamp < self.cur_timestamp:
            message.timestamp = self.cur_timestamp  # FS asserts that timestamps never decrease; they are simulated
        return problem

    def callback_funcs_for_join_in(self, message: Message):
        """With a keyring or TLS, a client joins as the id of its key or certificate (set by
        :meth:`_message_problem`), and is told so;
        FS's own handler numbers clients in the order they join, which anyone can race."""
        self._progress = time.monotonic()  # a join the checks let through: the join wait starts again
        if not (self._keyring or self._tls) or message.msg_type != "join_in":
            return super().callback_funcs_for_join_in(message)
        sender = message.sender
        self.join_in_client_num += 1
        self.comm_manager.add_neighbors(neighbor_id=sender, address=message.content)
        send(self, "assign_client_id", sender, str(sender), self.cur_timestamp)
        if len(self._cfg.federate.join_in_info) != 0:
            send(self, "ask_for_join_in_info", sender, self._cfg.federate.join_in_info.copy(), self.cur_timestamp)
        self.trigger_for_start()

    def callback_funcs_for_metrics(self, message: Message):
        """FS's handler, for a new evaluation of the round being evaluated only: another (a replay, an earlier
        round's, a second one from the same client, one from a client not asked) is dropped, so that it neither
        counts nor keeps the round alive for the watchdog."""
        sender, rnd = message.sender, message.state
        new = rnd == self._eval_round and sender in self._eval_expected
        if not new or sender in self.msg_buffer["eval"].get(rnd, {}):
            if not self.is_finish:
                what = "sent it already" if new else f"was not asked to evaluate round {str(rnd)[:40]}"
                logger.warning(f"[fedpa] round {self.state}: ignored a message: an evaluation from client "
                               f"{str(sender)[:40]}, which {what}")  # fmt: skip
            return False
        self._progress = time.monotonic()
        if isinstance(message.content, dict) and EVAL_SECONDS in message.content:  # the run's report's, not FS's
            content = dict(message.content)
            self.report.eval_seconds(rnd, sender, content.pop(EVAL_SECONDS))
            message.content = content
        return super().callback_funcs_for_metrics(message)

    def callback_funcs_model_para(self, message: Message):
        """FS's handler, after refusing an update of this round from a sender that was not sent this round's model
        (an unknown or impersonated id) or that already sent one: FS's bookkeeping would crash on the first and
        let the second overwrite or miscount the round's updates."""
        sender, rnd = message.sender, message.state
        problem = None
        if isinstance(sender, bool) or not isinstance(sender, int) or not 1 <= sender <= self.client_num:
            problem = f"sender id {str(sender)[:40]!r} is not a client of this run (1..{self.client_num})"
        elif rnd == self.state and sender not in self._expected:
            problem = f"client #{sender} was not sent the model of round {rnd}"
        elif rnd == self.state and sender in self.msg_buffer["train"].get(rnd, {}):
            problem = f"client #{sender} already sent its update of round {rnd}"
        if problem is not None and not self.is_finish:
            logger.warning(f"[fedpa] round {self.state}: ignored a message: {problem}")
            return False
        if rnd == self.state:  # only this round's updates keep it alive
            self._progress = time.monotonic()
        return super().callback_funcs_model_para(message)


def _parsed(raw) -> tuple[Message, str | None]:
    """FS's :class:`Message` of a gRPC request, field by field: FS's parser asserts on a field of the wrong type (a
    string timestamp) or fails on a missing one, and the field that fails is the reason the message is dropped.
    The fields it could read are set, so the reason can name the claimed sender."""
    message = Message()
    for name in ("msg_type", "sender", "receiver", "state", "content", "timestamp"):
        if name not in raw.msg:
            return message, f"{name}: the message has no such field"
        try:
            value = message._parse_msg(raw.msg[name])
        except (TypeError, ValueError, AttributeError) as err:  # e.g. a field with no value set
            return message, f"{name}: FS cannot parse it ({type(err).__name__}: {err})"
        try:
            setattr(message, name, value)
        except (AssertionError, TypeError, ValueError) as err:  # FS's setters assert on the type
            return message, f"{name} {str(value)[:40]!r} is not a value FS accepts ({err})"
    return message, None


def guard_fs_byte_count() -> None:
    """Make FS's byte counter safe against a client's message (once per process; FS without FedPA never gets here).

    FS's standalone runner counts every message's bytes (``Message.count_bytes``: pympler's ``asizeof`` over every
    object of the content) before it hands the message to any handler, and pympler raises on some objects (a numpy
    array broadcast to 10^12 entries): one client's message stopped the whole run before the server saw it. This is
    the plugin's earliest hook. A client's update is counted only if :func:`check_message_content` finds nothing
    but plain dicts, numbers, strings and tensors that hold their values in it; otherwise, or if the count still
    raises, FS counts 0 bytes, with a warning naming the sender, and the server's intake drops the update with its
    reason. Messages FS counts without an error are counted exactly as before."""

    def guarded(original):
        def count_bytes(message):
            sender = message.sender if type(message.sender) is int else "?"
            problem = check_message_content(message.content) if message.msg_type == "model_para" and sender else None
            if problem is None:
                try:
                    return original(message)
                except Exception as err:  # pympler on an object it cannot size
                    problem = f"{type(err).__name__}: {shown(err, 200)}"
            logger.warning(
                f"[fedpa] FS's byte counter skipped a {shown(message.msg_type)} message from {sender} (counted as 0 "
                f"bytes): {problem}"
            )
            return 0, 0

        return count_bytes

    fs_patches.guard_count_bytes(guarded)
