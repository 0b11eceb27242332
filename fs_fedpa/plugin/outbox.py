"""What leaves a client (:class:`ClientOutbox`, a collaborator of :class:`~fs_fedpa.plugin.client.FedPAClient`):
every message FS's ``comm_manager.send`` is given is checked against the server's intake, then, in distributed mode
with ``fedpa.net.auth_key``, signed (:mod:`fs_fedpa.plugin.auth`), then handed to FS's transport."""

from __future__ import annotations

from collections.abc import Callable

from federatedscope.core.message import Message

from fs_fedpa.plugin import auth, fs_patches
from fs_fedpa.plugin.messages import reply_problem


class ClientOutbox:
    """Installed on FS's ``comm_manager`` (:func:`fs_fedpa.plugin.fs_patches.wrap_send`). ``ids()``: the client's
    FS id and its server's (the id arrives when a distributed client has joined); ``run_size``: (rounds, clients)
    of the run, as the server checks a message against them; ``key``: the client's signing key, or None.

    :attr:`deliver` sends a checked message (signed first, with a key) through FS's transport."""

    def __init__(self, comm_manager, ids: Callable[[], tuple[int, int]], run_size: tuple[int, int],
                 key: bytes | None = None):  # fmt: skip
        self.ids, self.run_size, self.key = ids, run_size, key
        self.answered = (0, 0.0)  # round and timestamp of the server's message the client answers now
        self.transport = fs_patches.wrap_send(comm_manager, lambda _: self.send)
        self.deliver: Callable[[Message], None] = self._signed if key is not None else self.transport

    def answering(self, rnd: int, timestamp: float) -> None:
        """The client handles the server's message of round ``rnd`` sent at ``timestamp``: its replies answer it."""
        self.answered = (rnd, timestamp)

    def send(self, message: Message) -> None:
        """Send ``message`` if the server would accept its fields (:func:`fs_fedpa.plugin.messages.reply_problem`,
        the checks of the server's intake); otherwise raise, naming the field: a subclass's mistake (a round of -1,
        a string state, an earlier timestamp) must not reach FS's runner, which fails on it far from the cause."""
        if message.msg_type in ("model_para", "metrics"):
            client, rnd, since = self.ids()[0], *self.answered
            fields = (message.msg_type, message.sender, message.state, message.timestamp, message.content)
            if problem := reply_problem(*fields, client, rnd, since, *self.run_size):
                raise ValueError(
                    f"[fedpa] client #{client}, round {rnd}: its {message.msg_type} message is malformed and was not "
                    f"sent: {problem}"
                )
        self.deliver(message)

    def _signed(self, message: Message) -> None:
        """``message``, with its content signed by the client's key when it goes to the server, to the transport."""
        server = self.ids()[1]
        if server in (message.receiver if isinstance(message.receiver, list) else [message.receiver]):
            fields = (message.msg_type, message.sender, message.state, message.timestamp)
            message.content = auth.sign(self.key, *fields, message.content)
        self.transport(message)
