"""Liveness and timeouts of both workers: a distributed party that hears nothing for too long says why and
stops (or, on the server, moves the round on with what arrived) instead of waiting forever.

:class:`ClientLiveness` and :class:`ServerLiveness` are mixins of :class:`~fs_fedpa.plugin.client.FedPAClient`
and :class:`~fs_fedpa.plugin.server.FedPAServer`: the watchdog threads, their own timeout messages (marked with
a token no peer knows) and their handlers, and the bound on joining. Standalone runs have no watchdog (nothing there
goes silent), but a standalone run that stops before its last round fails, naming the round (:meth:`ServerLiveness
._watch_the_end`)."""

from __future__ import annotations

import logging
import threading
import time

from federatedscope.core.message import Message

from fs_fedpa.plugin import fs_patches

logger = logging.getLogger(f"federatedscope.{__name__}")  # FS configures its own logger tree only
CLIENT_TIMEOUT = "fedpa_client_timeout"  # the client watchdog's message type
TIMEOUT = "fedpa_round_timeout"  # the server watchdog's message type


class ClientLiveness:
    """The client's watchdog (needs ``_token``, ``_heard`` and ``_waiting``, set by the client)."""

    def run(self):
        """FS's distributed loop, with a watchdog: a client that hears nothing from the server for
        ``fedpa.net.client_timeout_s`` while it waits exits non-zero with the reason instead of waiting forever."""
        timeout = self.method.cfg.net.client_timeout_s
        if self._cfg.federate.mode.lower() == "distributed" and timeout > 0:
            self.register_handlers(CLIENT_TIMEOUT, self._on_client_timeout, [None])

            def waiting(receive):
                def waiting_receive():
                    self._heard, self._waiting = time.monotonic(), True
                    try:
                        return receive()
                    finally:
                        self._heard, self._waiting = time.monotonic(), False

                return waiting_receive

            fs_patches.wrap_receive(self.comm_manager, waiting)
            threading.Thread(target=self._watchdog, args=(timeout,), daemon=True, name="fedpa-client-watchdog").start()
        return super().run()

    def _watchdog(self, timeout: float) -> None:
        """Puts a timeout message into the client's own queue once it has waited ``timeout`` seconds."""
        while True:
            time.sleep(min(1.0, timeout / 10))
            if self._waiting and time.monotonic() - self._heard > timeout:
                message = Message(
                    msg_type=CLIENT_TIMEOUT, sender=self.ID, receiver=[self.ID], state=2**30, content=self._token
                )
                self.comm_manager.server_funcs.msg_queue.append(message.transform(to_list=True))
                return

    def _on_client_timeout(self, message: Message):
        if message.content != self._token:  # not its own watchdog's: a peer's forgery
            logger.warning(f"[fedpa] client #{self.ID}: ignored a {CLIENT_TIMEOUT} message it did not send itself")
            return
        raise RuntimeError(
            f"[fedpa] client #{self.ID}: no message from the server for fedpa.net.client_timeout_s="
            f"{self.method.cfg.net.client_timeout_s:g} s (round {self.state}); the server is gone or unreachable, "
            "exiting"
        )


class ServerLiveness:
    """The server's watchdog (needs ``_token``, ``_progress`` and ``_keyring``, set by the server); an accepted join,
    and a new update or evaluation of the current round, move ``_progress`` (:mod:`fs_fedpa.plugin.inbox`)."""

    def run(self):
        """FS's distributed loop, with a watchdog: a round that gets no message for ``fedpa.net.round_timeout_s`` is
        moved on with what arrived, or the run stops with the reason (FS would wait forever for a dead client)."""
        cfg = self.method.cfg.net
        distributed = self._cfg.federate.mode.lower() == "distributed"
        if distributed and (cfg.round_timeout_s > 0 or cfg.join_timeout_s > 0):
            self.register_handlers(TIMEOUT, self._on_round_timeout, [None])
            self._progress = time.monotonic()
            threading.Thread(target=self._watchdog, daemon=True, name="fedpa-watchdog").start()
        result = super().run()
        self._raise_if_unfinished("FS's loop ended")  # it also ends on its own failure count, with exit 0
        return result

    def _watch_the_end(self) -> None:
        """Standalone: FS's runner never calls :meth:`run`; it stops when no message is left to handle and then calls
        the server monitor's ``finish_fed_runner``, which therefore also checks that every round was trained and,
        under DP, logs the (epsilon, delta) spent as the run's last line."""

        def checked(finish):
            def finish_fed_runner(*args, **kwargs):
                result = finish(*args, **kwargs)
                self._raise_if_unfinished("no message was left to handle")
                if summary := self.privacy.summary():  # the run's last line: the (epsilon, delta) it spent
                    logger.info(summary)
                return result

            return finish_fed_runner

        fs_patches.wrap_finish(self._monitor, checked)

    def _raise_if_unfinished(self, how: str) -> None:
        """RuntimeError (the process exits non-zero) if the run stopped before its last round, naming the round and
        the updates it waited for; an early stop (FS's ``early_stop``) is a finish."""
        if self.state >= self.total_round_num:
            return
        train = self.msg_buffer["train"].get(self.state, {})
        missing = sorted(self._expected - set(train))
        waiting = f" (none from clients {missing})" if missing else ""
        raise RuntimeError(
            f"[fedpa] the run ended after {self.state} of federate.total_round_num={self.total_round_num} rounds: "
            f"{how} while round {self.state} had {len(train)} of {len(self._expected)} updates{waiting}; the reasons "
            "are in the log above"
        )

    def _watchdog(self) -> None:
        """Puts a timeout message into the server's own queue when no client joined for ``fedpa.net.join_timeout_s``
        while clients are missing, or no update or evaluation of the round arrived for ``fedpa.net.round_timeout_s``
        (0: no limit). Only an accepted join, or a new message of the current round, moves ``_progress``."""
        cfg = self.method.cfg.net
        while not self.is_finish:
            joining = self.join_in_client_num < self.client_num
            timeout = cfg.join_timeout_s if joining else cfg.round_timeout_s
            time.sleep(min(1.0, timeout / 10) if timeout > 0 else 1.0)
            if timeout > 0 and time.monotonic() - self._progress > timeout:
                self._progress = time.monotonic()
                message = Message(
                    msg_type=TIMEOUT, sender=self.ID, receiver=[self.ID], state=self.state, content=self._token
                )
                self.comm_manager.server_funcs.msg_queue.append(message.transform(to_list=True))

    def _on_round_timeout(self, message: Message):
        if self.is_finish:
            return False
        cfg = self.method.cfg.net
        if self.join_in_client_num < self.client_num:
            return self._stop_joining()
        train = self.msg_buffer["train"].get(self.state, {})
        missing = sorted(self._expected - set(train))
        if self.state < self.total_round_num and missing:
            if len(train) < cfg.min_received:
                reason = (
                    f"round {self.state}: {len(train)} of {len(self._expected)} updates within "
                    f"fedpa.net.round_timeout_s={cfg.round_timeout_s:g} s, fewer than "
                    f"fedpa.net.min_received={cfg.min_received} (no update from clients {missing})"
                )
                logger.error(f"[fedpa] {reason}; stopping the run")
                self.terminate(msg_type="finish")  # the clients that are alive exit too
                raise RuntimeError(f"[fedpa] {reason}")
            logger.warning(
                f"[fedpa] round {self.state}: no update from clients {missing} within fedpa.net.round_timeout_s="
                f"{cfg.round_timeout_s:g} s; aggregating the {len(train)} that arrived"
            )
            self.sampler.change_state(missing, "idle")  # FS samples idle clients only; they may come back
            return self.check_and_move_on(min_received_num=len(train))
        evaluations = self.msg_buffer["eval"]
        arrived = len(evaluations[max(evaluations)]) if evaluations else 0
        if arrived:
            logger.warning(
                f"[fedpa] round {self.state}: {arrived} evaluations within fedpa.net.round_timeout_s="
                f"{cfg.round_timeout_s:g} s; merging those"
            )
            return self.check_and_move_on(check_eval_result=True, min_received_num=arrived)
        return False

    def _stop_joining(self):
        """No client joined for ``fedpa.net.join_timeout_s`` while some are missing: stop non-zero, naming them (with a
        keyring, the ids of the keys that never joined; without, FS numbers clients in the order they join)."""
        joined = set(self.comm_manager.neighbors)
        expected = set(self._keyring) if self._keyring else set(range(1, self.client_num + 1))
        missing = sorted(expected - joined) if self._keyring else sorted(expected)[len(joined) :]
        reason = (
            f"{len(joined)} of {self.client_num} clients joined, then none for fedpa.net.join_timeout_s="
            f"{self.method.cfg.net.join_timeout_s:g} s; clients {missing} never joined (joins the server refused, "
            "with their reasons, are in the log above)"
        )
        logger.error(f"[fedpa] {reason}; stopping the run")
        self.terminate(msg_type="finish")  # the clients that joined exit too
        raise RuntimeError(f"[fedpa] {reason}")
