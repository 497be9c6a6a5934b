"""A warm interpreter for the suite's one-process CLI runs.

Every `finetune` subprocess spends ~8 s of one core importing torch, transformers and TRL
before it does anything; the suite starts hundreds. This server imports them once, then
forks a child per request that runs `finetune.cli.main(argv)` in the request's directory
and environment, with its output in files, and reports the child's exit status. The child
is a real process (its own pid, signals, exit status, open files); what it skips is only
the import. The server forks from a single thread that has run no torch op, so no lock or
thread pool is copied half-way.

Used by conftest.run_cli and resumable.Run, through conftest.warm_interpreter: one
server per environment (the libraries read some variables once, at import, so a child
must come from a server started with the environment the test has now). Protocol: one JSON line per connection each way:
  -> {"argv": [...], "cwd": str, "env": {...}, "stdout": path, "stderr": path}
  <- {"pid": int}        then, when the child ends,   <- {"returncode": int}
"""

from __future__ import annotations

import json
import os
import random
import selectors
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import threading

# What a training, inference or evaluation process imports: all of it, once.
WARM_IMPORTS = (
    "torch", "numpy", "safetensors.torch", "datasets", "accelerate", "peft", "transformers",
    "transformers.models.llama.modeling_llama", "trl", "finetune.cli", "finetune.run.worker",
    "finetune.methods", "finetune.inference.cli", "finetune.commands.eval_saved",
    "finetune.estimate", "finetune.model.varlen", "finetune.report.plots",
    "matplotlib.figure", "matplotlib.backends.backend_agg",
    # Imported by every save (accelerate's unwrap looks for a DeepSpeed engine): 0.6 s a run.
    "deepspeed",
)


def warm_up() -> None:
    import importlib

    for name in WARM_IMPORTS:
        importlib.import_module(name)
    # TRL's trainers sit behind lazy attributes; touching them imports their modules.
    import trl

    for name in ("SFTTrainer", "DPOTrainer", "KTOTrainer", "RewardTrainer", "GRPOTrainer",
                 "RLOOTrainer", "GKDTrainer"):
        getattr(trl, name, None)
    # transformers builds its table of checkpoint key renamings (~900 regular expressions,
    # 0.5-1 s) at a process's first model save or load, and keeps it: built once, here.
    from transformers.conversion_mapping import get_checkpoint_conversion_mapping

    get_checkpoint_conversion_mapping("llama")
    if threading.active_count() != 1:  # a fork would copy another thread's locks
        raise RuntimeError(f"threads after the imports: {threading.enumerate()}")
    # The imported modules' objects live as long as the server: out of the collector's
    # reach, a child's gc.collect() (accelerate calls it at every free_memory) no longer
    # walks them (0.4 s a run) and its pages are not copied just to touch their GC headers.
    import gc

    gc.freeze()


def child(request: dict) -> None:
    """In the forked child: become `python -m finetune ARGV` run from request['cwd']."""
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    opened: dict[str, int] = {}  # one open file for both when the paths are the same
    for fd, path in ((1, request["stdout"]), (2, request["stderr"])):
        if path not in opened:
            opened[path] = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        os.dup2(opened[path], fd)
    for out in opened.values():
        os.close(out)
    for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGUSR1, signal.SIGCHLD):
        signal.signal(sig, signal.default_int_handler if sig == signal.SIGINT
                      else signal.SIG_DFL)
    # A cold process draws fresh seeds; a fork would repeat the server's.
    random.seed()
    import numpy
    import torch

    numpy.random.seed(int.from_bytes(os.urandom(4), "little"))
    torch.seed()
    from importlib.util import find_spec

    sys.argv = [find_spec("finetune.__main__").origin, *request["argv"]]
    sys.path[0] = os.getcwd()  # as `python -m` puts the working directory first
    from finetune.cli import main

    try:
        code = main(request["argv"])
    except SystemExit as exc:
        code = exc.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    # Python's exit, less the teardown of every module (a second or two with torch and
    # TRL loaded, which a cold `finetune validate` never imports): wait for the threads
    # the run left (as the interpreter does), run the atexit handlers, flush, exit.
    for thread in threading.enumerate():
        if thread is not threading.main_thread() and not thread.daemon:
            thread.join()
    import atexit

    atexit._run_exitfuncs()
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (OSError, ValueError):
            pass
    os._exit(code if isinstance(code, int) else (0 if code is None else _message(code)))


def _message(code) -> int:
    """SystemExit("text") prints the text and exits 1, as the interpreter does."""
    print(code, file=sys.stderr, flush=True)
    return 1


def serve(path: str) -> None:
    warm_up()
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(16)
    print("ready", flush=True)
    waiting: dict[int, socket.socket] = {}  # child pid -> the connection to answer
    selector = selectors.DefaultSelector()
    selector.register(listener, selectors.EVENT_READ)
    while True:
        for _key, _ in selector.select(timeout=0.02):
            conn, _ = listener.accept()
            with conn.makefile("r") as lines:
                request = json.loads(lines.readline())
            pid = os.fork()
            if pid == 0:
                selector.close()
                listener.close()
                conn.close()
                child(request)
            conn.sendall((json.dumps({"pid": pid}) + "\n").encode())
            waiting[pid] = conn
        while waiting:
            pid, status = os.waitpid(-1, os.WNOHANG)
            if pid == 0:
                break
            conn = waiting.pop(pid, None)
            if conn is None:
                continue
            code = os.waitstatus_to_exitcode(status)
            try:
                conn.sendall((json.dumps({"returncode": code}) + "\n").encode())
            except OSError:  # the test gave up on it (a timeout)
                pass
            conn.close()
        if os.getppid() == 1:  # pytest is gone
            return


class WarmInterpreter:
    """The test process's side: start the server once, then run(argv, cwd, timeout) like
    subprocess.run([python, -m, finetune, *argv], capture_output=True, text=True)."""

    def __init__(self) -> None:
        self.env = dict(os.environ)
        self.dir = tempfile.mkdtemp(prefix="finetune-warm-")
        self.socket = os.path.join(self.dir, "socket")
        self.log = os.path.join(self.dir, "server.log")
        with open(self.log, "w") as log:
            self.server = subprocess.Popen([sys.executable, __file__, self.socket],
                                           stdout=subprocess.PIPE, stderr=log, text=True,
                                           env=self.env)
        # Imports may print first (wandb offline says so on stdout): skip to "ready".
        for line in self.server.stdout:
            if line.strip() == "ready":
                break
        else:
            self.server.kill()
            raise RuntimeError(f"the warm interpreter did not start: {_read(self.log)[-3000:]}")
        self.count = 0

    def alive(self) -> bool:
        return self.server.poll() is None

    def start(self, argv: list[str], cwd, stdout: str, stderr: str) -> WarmProcess:
        """Like subprocess.Popen([python, -m, finetune, *argv], cwd=cwd) with its output to
        the files stdout and stderr (the same path: both to one file, as stderr=STDOUT)."""
        request = {"argv": [str(arg) for arg in argv], "cwd": str(cwd),
                   "env": dict(os.environ), "stdout": str(stdout), "stderr": str(stderr)}
        conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        conn.connect(self.socket)
        conn.sendall((json.dumps(request) + "\n").encode())
        return WarmProcess(conn, [sys.executable, "-m", "finetune", *request["argv"]])

    def run(self, argv: list[str], cwd, timeout: float) -> subprocess.CompletedProcess:
        """Like subprocess.run([python, -m, finetune, *argv], cwd=cwd, timeout=timeout,
        capture_output=True, text=True)."""
        self.count += 1
        out = os.path.join(self.dir, f"{self.count}.out")
        err = os.path.join(self.dir, f"{self.count}.err")
        proc = self.start(argv, cwd, out, err)
        try:
            code = proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise subprocess.TimeoutExpired(proc.args, timeout, _read(out), _read(err))
        result = subprocess.CompletedProcess(proc.args, code, _read(out), _read(err))
        os.unlink(out)
        os.unlink(err)
        return result

    def close(self) -> None:
        self.server.kill()
        self.server.wait()
        shutil.rmtree(self.dir, ignore_errors=True)


class WarmProcess:
    """A forked child, as much of subprocess.Popen as the tests use: pid, args, poll(),
    wait(timeout), send_signal(), kill(), returncode. The server reports its exit status
    on the connection.

    The child is the server's, not ours: the server reaps it as soon as it ends, and its
    pid may then be given to any new process or thread (pid_max is 32768 here and the suite
    starts tens of thousands). Signals therefore go through a pidfd, opened at once, which
    names this process and no later one: a SIGKILL to a stale pid could hit any process of
    the machine (a SLURM daemon, another test's run)."""

    def __init__(self, conn: socket.socket, args: list[str]):
        self.conn, self.args, self.returncode = conn, args, None
        self._buffer = b""
        self.pid = json.loads(self._line(None))["pid"]
        try:
            self._pidfd: int | None = os.pidfd_open(self.pid)
        except ProcessLookupError:  # already ended and reaped: nothing left to signal
            self._pidfd = None

    def _line(self, timeout: float | None) -> bytes:
        self.conn.settimeout(timeout)
        while b"\n" not in self._buffer:
            chunk = self.conn.recv(4096)
            if not chunk:
                raise RuntimeError(f"the warm interpreter ended while running {self.args}")
            self._buffer += chunk
        line, self._buffer = self._buffer.split(b"\n", 1)
        return line

    def wait(self, timeout: float | None = None) -> int:
        if self.returncode is None:
            try:
                self.returncode = json.loads(self._line(timeout))["returncode"]
            except TimeoutError:
                raise subprocess.TimeoutExpired(self.args, timeout) from None
            self.conn.close()
            self._close_pidfd()
        return self.returncode

    def _close_pidfd(self) -> None:
        if self._pidfd is not None:
            os.close(self._pidfd)
            self._pidfd = None

    def poll(self) -> int | None:
        if self.returncode is None:
            try:
                self.wait(0.001)
            except subprocess.TimeoutExpired:
                pass
        return self.returncode

    def send_signal(self, signum: int) -> None:
        if self.returncode is None and self._pidfd is not None:
            try:
                signal.pidfd_send_signal(self._pidfd, signum)
            except ProcessLookupError:  # ended, not yet reported: as Popen, a no-op
                pass

    def running(self) -> bool:
        """Whether this child still exists (not merely its pid, which may be another's)."""
        if self.returncode is not None or self._pidfd is None:
            return False
        try:
            signal.pidfd_send_signal(self._pidfd, 0)
        except ProcessLookupError:
            return False
        return True

    def __del__(self) -> None:
        self._close_pidfd()

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


def _read(path: str) -> str:
    try:
        with open(path, errors="replace") as handle:  # as text=True decodes (universal newlines)
            return handle.read()
    except FileNotFoundError:
        return ""


if __name__ == "__main__":
    serve(sys.argv[1])
