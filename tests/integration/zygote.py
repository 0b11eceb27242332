"""An interpreter that has imported torch, transformers, PEFT, FS and the plugin once, and forks a child for each FS
run a test asks for: the child runs ``python -m <module> <args>`` as a fresh interpreter would (its own cwd,
environment, argv, ``sys.path[0]``, stdin from /dev/null, stdout and stderr to files, ``__main__``, exit status),
without paying the ~10 s of imports again. Those imports were about half of the suite's time (35 min with a fresh
interpreter for every run, 19 with the zygote, on 2 cores); tests/integration/test_zygote_fs.py checks that a forked
FS run equals a fresh interpreter's, metric for metric and tensor for tensor.

What differs: what the preloaded modules print while importing goes to the zygote's log, not to the run's output
(tests that assert a command's whole output run it in a fresh interpreter), and the children share one hash seed.
A run whose interpreter options or import-time environment differ runs in a fresh interpreter (``run_module``).

Protocol: the zygote says ``ready`` on a line once it has imported; then one JSON request a line on stdin:
``{"module", "args", "cwd", "env", "stdout", "stderr"}``, which it answers with the child's pid on a line, then its
exit status on another (negative: killed by that signal).

A slow host never fails a run: until the zygote is ready a run waits for it up to ``FS_FEDPA_ZYGOTE_FORK_TIMEOUT``
seconds (300 by default; its imports take about 10 s on a quiet host), then runs in a fresh interpreter, as do
the runs after it until the zygote is ready (they no longer wait).
"""

from __future__ import annotations

import importlib
import json
import os
import sys

SLOW = "FS_FEDPA_TEST_ZYGOTE_SLOW"  # seconds: the zygote sleeps that long instead of importing (its tests)

# What every FS run imports before it reads its config (FS's main, its builders, the plugin's workers).
PRELOAD = (
    "torch",
    "transformers",
    "peft",
    "federatedscope.core.configs.config",
    "federatedscope.core.cmd_args",
    "federatedscope.core.auxiliaries.data_builder",
    "federatedscope.core.auxiliaries.model_builder",
    "federatedscope.core.auxiliaries.trainer_builder",
    "federatedscope.core.auxiliaries.worker_builder",
    "federatedscope.core.fed_runner",
    "fs_fedpa.plugin.client",
    "fs_fedpa.plugin.server",
)


def _child(request: dict, reply_fd: int, request_fd: int) -> None:
    """In the forked child: become ``python -m module args`` and exit with its status; never returns."""
    code = 1
    try:
        os.close(reply_fd)
        os.close(request_fd)
        for fd, path, flags in ((0, os.devnull, os.O_RDONLY), (1, request["stdout"], os.O_WRONLY | os.O_CREAT),
                                (2, request["stderr"], os.O_WRONLY | os.O_CREAT)):  # fmt: skip
            opened = os.open(path, flags | (os.O_TRUNC if fd else 0), 0o644)
            os.dup2(opened, fd)
            os.close(opened)
        sys.stdin = open(0, closefd=False)  # noqa: SIM115  (fd 0 is /dev/null now; the zygote's buffer is gone)
        os.chdir(request["cwd"])
        os.environ.clear()
        os.environ.update(request["env"])
        sys.path[0] = request["cwd"]  # what ``python -m`` puts first
        sys.argv = [request["module"], *request["args"]]
        import runpy

        try:
            runpy.run_module(request["module"], run_name="__main__", alter_sys=True)
            code = 0
        except SystemExit as exc:  # the interpreter's rule for sys.exit's argument
            if exc.code is None or isinstance(exc.code, int):
                code = exc.code or 0
            else:
                print(exc.code, file=sys.stderr)
                code = 1
        except BaseException:  # noqa: BLE001  (what the interpreter prints for an uncaught exception)
            sys.excepthook(*sys.exc_info())
            code = 1
        import atexit
        import logging

        atexit._run_exitfuncs()
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
    finally:
        os._exit(code)


def serve() -> None:
    reply = os.fdopen(os.dup(1), "w", buffering=1)
    requests = os.fdopen(os.dup(0), "r", buffering=1)
    os.dup2(2, 1)  # whatever an import prints goes to the zygote's stderr, never into the replies
    if slow := os.environ.get(SLOW):  # the tests of a slow host: a sleep in place of the imports
        import time

        time.sleep(float(slow))
    for name in PRELOAD if not slow else ():
        try:
            importlib.import_module(name)
        except Exception as exc:  # noqa: BLE001  (a child imports it itself, and fails as a fresh interpreter would)
            print(f"zygote: could not preload {name}: {exc}", file=sys.stderr)
    reply.write("ready\n")
    for line in requests:
        request = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            _child(request, reply.fileno(), requests.fileno())
        reply.write(f"{pid}\n")
        _, status = os.waitpid(pid, 0)
        reply.write(f"{os.waitstatus_to_exitcode(status)}\n")


# ------------------------------------------------------------------------------------------------------------------ #
# the tests' side
# ------------------------------------------------------------------------------------------------------------------ #
FRESH = "FS_FEDPA_TEST_FRESH_INTERPRETERS"  # =1: every run in a fresh interpreter, as before the zygote
FORK_LIMIT = "FS_FEDPA_ZYGOTE_FORK_TIMEOUT"  # seconds a run waits for the zygote's imports (or its fork), or 300


def _fork_limit() -> float:
    try:
        return max(0.0, float(os.environ.get(FORK_LIMIT) or 300))
    except ValueError:
        return 300.0
# read while a run runs (or not at all), never on import; the trackers' (fedpa.track) when the server opens one.
# CRC32C_SW_MODE: set by tensorboardX's import (a test that imports it changes its process's environment) and read
# by the crc32c package, which nothing the zygote preloads imports
_RUNTIME_KEYS = ("FS_PROBE_", "PYTEST_", "FS_FEDPA_TEST_", "WANDB_", "MLFLOW_", "CRC32C_")


def _import_env(env: dict) -> dict:
    """What of ``env`` the preloaded imports can read."""
    return {k: v for k, v in env.items() if not k.startswith(_RUNTIME_KEYS)}


class Zygote:
    """One zygote per test process, started on first use with ``env`` (what it imports under) and ``root`` as cwd."""

    def __init__(self, env: dict, root: str):
        import subprocess
        import tempfile

        self.env = env
        self._log = tempfile.NamedTemporaryFile(prefix="fs_fedpa_zygote_", suffix=".log", delete=False)  # noqa: SIM115
        self.proc = subprocess.Popen([sys.executable, "-m", "tests.integration.zygote"], cwd=root, env=env,
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=self._log)  # fmt: skip
        self._buffer = b""
        self.ready, self.late = False, False  # late: it missed the limit once, and no run waits for it again

    def takes(self, env: dict) -> bool:
        """Whether a run under ``env`` would import exactly what it imports under the zygote's environment."""

        return self.proc.poll() is None and _import_env(env) == _import_env(self.env)

    def _line(self, deadline: float | None) -> str | None:
        import select
        import time

        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buffer:
            wait = None if deadline is None else max(0.0, deadline - time.monotonic())
            if not select.select([fd], [], [], wait)[0]:
                return None
            chunk = os.read(fd, 4096)
            if not chunk:
                raise RuntimeError(f"the test zygote exited; its log: {self._log.name}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line.decode()

    def _is_ready(self) -> bool:
        """Whether the zygote has imported: waits up to the limit, or only looks once it has missed it."""
        import time

        if not self.ready:
            try:
                line = self._line(time.monotonic() + (0.0 if self.late else _fork_limit()))
            except RuntimeError:  # it exited while importing
                return False
            self.ready, self.late = line == "ready", line is None
            if line is not None and not self.ready:
                raise RuntimeError(f"the test zygote said {line!r} instead of 'ready'; its log: {self._log.name}")
        return self.ready

    def run(self, module: str, args: list[str], cwd: str, env: dict, timeout: float | None):
        """``subprocess.run([python, -m, module, *args], cwd, env, capture_output=True, text=True, timeout)``; in a
        fresh interpreter while the zygote is not ready (a slow host: ``FS_FEDPA_ZYGOTE_FORK_TIMEOUT``)."""
        import signal
        import subprocess
        import tempfile
        import time

        cmd = [sys.executable, "-m", module, *args]
        if not self._is_ready():
            print(f"[zygote] not ready within {_fork_limit():g} s ({FORK_LIMIT}): {module} runs in a fresh "
                  "interpreter", file=sys.stderr)  # fmt: skip
            return _fresh(cmd, cwd, env, timeout)
        with tempfile.TemporaryDirectory(prefix="fs_fedpa_run_") as tmp:
            out, err = os.path.join(tmp, "stdout"), os.path.join(tmp, "stderr")
            request = {"module": module, "args": list(args), "cwd": str(cwd), "env": env, "stdout": out, "stderr": err}
            self.proc.stdin.write((json.dumps(request) + "\n").encode())
            self.proc.stdin.flush()
            pid = int(self._line(time.monotonic() + _fork_limit()) or "0")
            if not pid:  # ready, yet no fork: stuck; the next run starts another
                self.proc.kill()
                self.proc.wait()
                print(f"[zygote] did not fork within {_fork_limit():g} s; its log: {self._log.name}; {module} runs "
                      "in a fresh interpreter", file=sys.stderr)  # fmt: skip
                return _fresh(cmd, cwd, env, timeout)
            code = self._line(None if timeout is None else time.monotonic() + timeout)

            def read(path: str) -> str:
                with open(path, errors="replace") as f:
                    return f.read()

            if code is None:
                os.kill(pid, signal.SIGKILL)
                self._line(None)
                raise subprocess.TimeoutExpired(cmd, timeout, output=read(out), stderr=read(err))
            return subprocess.CompletedProcess(cmd, int(code), read(out), read(err))


def _fresh(cmd: list[str], cwd, env: dict, timeout: float | None):
    import subprocess

    return subprocess.run(cmd, cwd=str(cwd), env=env, capture_output=True, text=True, timeout=timeout)


_zygote: Zygote | None = None


def run_module(module: str, args, cwd, env: dict, timeout: float | None, *, base: dict, root: str, python_args=()):
    """Run ``python <python_args> -m module args`` like ``subprocess.run(..., capture_output=True, text=True)``: in a
    child of the zygote (started under ``base`` in ``root``) where that is the same run (no interpreter options, an
    environment equal to ``base`` but for what runs read while running), else in a fresh interpreter."""
    global _zygote
    args = [str(a) for a in args]
    if not python_args and os.environ.get(FRESH) != "1":
        if _zygote is None or _zygote.proc.poll() is not None:
            _zygote = Zygote(_import_env(base), str(root))
        if _zygote.takes(env):
            return _zygote.run(module, args, cwd, env, timeout)
    return _fresh([sys.executable, *python_args, "-m", module, *args], cwd, env, timeout)


if __name__ == "__main__":
    serve()
