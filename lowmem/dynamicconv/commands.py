"""fairseq's console commands (``fairseq-train``, ``-generate``, ``-preprocess``), each in a process of its own, forked
from one server process that imported fairseq once.

A command runs as ``python -m fairseq_cli.<tool>`` would: its module runs as ``__main__`` with the command's argv and
environment, in a process of its own, so a crash or a leak stays there. Only the imports are shared: importing
fairseq takes 3.5-5 s on 2 cores (it imports every task it ships, one of them scikit-learn), and a stage, a notebook
or a test file runs up to a dozen commands.

Why a server of our own and not multiprocessing's ``forkserver``: that one fixes the environment when it starts and
runs the caller's ``__main__`` again in every child, and a command needs its own environment (the unsafe-load setting
for fairseq's checkpoints only, issue 49). The server holds no threads and runs no tensor op, so forking it is safe.

Protocol: one JSON request a line on the server's stdin, one JSON answer a line (the exit status, negative for a
signal, as ``subprocess``) on a pipe of its own; the server's stdout and stderr carry only fairseq's import-time noise.
When its caller goes away or is interrupted (stdin closes), the server stops the command it runs and exits.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import IO

TOOLS = ("train", "generate", "preprocess")


def _child(req: dict) -> None:
    """In the forked child: become ``python -m fairseq_cli.<tool> argv...`` with the request's environment."""
    import logging
    import runpy
    import traceback
    import warnings

    code = 1
    try:
        os.chdir(req["cwd"])
        for fd, path in ((1, req["stdout"]), (2, req["stderr"])):
            out = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
            os.dup2(out, fd)
            os.close(out)
        os.environ.clear()
        os.environ.update(req["env"])
        if "OMP_NUM_THREADS" in req["env"]:  # the server's torch read the server's environment at import
            import torch

            torch.set_num_threads(int(req["env"]["OMP_NUM_THREADS"]))
        if req["env"].get("PYTHONWARNINGS") == "ignore":  # read at interpreter start, which this child skipped
            warnings.simplefilter("ignore")
        logging.root.handlers.clear()  # so that the tool's own logging.basicConfig applies, as in a fresh process
        sys.argv = [f"fairseq-{req['tool']}", *req["argv"]]
        runpy.run_module(f"fairseq_cli.{req['tool']}", run_name="__main__", alter_sys=True)
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
        if not isinstance(e.code, int | None):
            print(e.code, file=sys.stderr)
    except BaseException:  # noqa: BLE001 - the child reports any failure as its exit status, as an interpreter does
        traceback.print_exc()
    finally:
        # os._exit skips the interpreter's teardown, where fairseq-train once aborted after finishing (translation.train)
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)


def serve(answers: int) -> None:
    """The server's loop: a request a line on stdin, each run in a fork; its exit status written to fd ``answers``."""
    for tool in TOOLS:
        __import__(f"fairseq_cli.{tool}")
    reply = os.fdopen(answers, "w", buffering=1)
    for line in sys.stdin:
        req = json.loads(line)
        sys.stdout.flush()
        sys.stderr.flush()
        pid = os.fork()
        if pid == 0:
            reply.close()  # so that the caller sees the server's end even while a command it forked runs on
            _child(req)
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            ready, _, _ = select.select([sys.stdin], [], [], 0.05)
            # The caller sends nothing while a command runs, so stdin readable now means it is gone: stop the command.
            if ready and not os.read(sys.stdin.fileno(), 1):
                os.kill(pid, signal.SIGTERM)
                os.waitpid(pid, 0)
                return
        reply.write(json.dumps(os.waitstatus_to_exitcode(status)) + "\n")


class _Server:
    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.proc: subprocess.Popen[str] | None = None
        self.answers: IO[str] | None = None
        self.noise: IO[bytes] | None = None  # the server's own output: fairseq's import-time messages, or its crash

    def start(self) -> None:
        r, w = os.pipe()
        self.noise = tempfile.TemporaryFile()
        self.proc = subprocess.Popen([sys.executable, "-m", __name__, str(w)], stdin=subprocess.PIPE, stdout=self.noise,
                                     stderr=self.noise, text=True, pass_fds=(w,))
        os.close(w)
        self.answers = os.fdopen(r, "r")

    def stop(self) -> None:
        """Closes the server's stdin, so that it stops the command it runs and exits."""
        if self.proc is not None:
            with contextlib.suppress(OSError):
                self.proc.stdin.close()  # type: ignore[union-attr]
            try:
                self.proc.wait(timeout=30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
            self.proc = None

    def run(self, req: dict, poll: Callable[[], None]) -> int:
        with self.lock:
            if self.proc is None or self.proc.poll() is not None:
                self.start()
            assert self.proc is not None and self.proc.stdin is not None and self.answers is not None
            try:
                self.proc.stdin.write(json.dumps(req) + "\n")
                self.proc.stdin.flush()
                while True:
                    ready, _, _ = select.select([self.answers], [], [], 1.0)
                    poll()
                    if ready:
                        line = self.answers.readline()
                        if not line:
                            raise RuntimeError(f"fairseq's command server died; its output:\n{self._noise()}")
                        return int(json.loads(line))
            except BaseException:
                # Interrupted (Ctrl-C in a notebook, say) or failed: the command must not run on behind this caller,
                # and the next one starts a fresh server.
                self.stop()
                raise

    def _noise(self) -> str:
        assert self.noise is not None
        self.noise.seek(0)
        return self.noise.read().decode(errors="replace")[-3000:]


_SERVER = _Server()


def env() -> dict[str, str]:
    """A fairseq command's environment: this process's, with the unsafe-load setting that fairseq's checkpoints need."""
    # torch >= 2.6 loads with weights_only=True, which cannot unpickle fairseq 0.12's checkpoints (environment notes).
    return {**os.environ, "TORCH_FORCE_NO_WEIGHTS_ONLY_LOAD": "1", "PYTHONWARNINGS": "ignore"}


def run(tool: str, argv: list[str], stdout: Path, stderr: Path | None = None, poll: Callable[[], None] = lambda: None) -> int:
    """Runs ``fairseq-<tool> argv`` in this directory with :func:`env`, appending its stdout to ``stdout`` (and its
    stderr to ``stderr``, or to ``stdout`` too); returns its exit status. ``poll`` is called about every second
    meanwhile (to follow the output)."""
    if tool not in TOOLS:
        raise ValueError(f"unknown fairseq command {tool!r}; known: {', '.join(TOOLS)}")
    req = {"tool": tool, "argv": [str(a) for a in argv], "env": env(), "cwd": os.getcwd(),
           "stdout": str(Path(stdout).absolute()), "stderr": str(Path(stderr or stdout).absolute())}
    return _SERVER.run(req, poll)


def captured(tool: str, argv: list[str]) -> subprocess.CompletedProcess[str]:
    """:func:`run`, with its stdout and stderr returned as ``subprocess.run(..., capture_output=True, text=True)``
    returns them."""
    with tempfile.TemporaryDirectory(prefix="fairseq-") as d:
        out, err = Path(d) / "stdout", Path(d) / "stderr"
        code = run(tool, argv, out, err)
        read = lambda f: f.read_text(errors="replace") if f.exists() else ""  # noqa: E731
        return subprocess.CompletedProcess([f"fairseq-{tool}", *argv], code, read(out), read(err))


if __name__ == "__main__":
    os.dup2(2, 1)  # fairseq's import-time logging goes to stderr, never into the answers
    serve(int(sys.argv[1]))
