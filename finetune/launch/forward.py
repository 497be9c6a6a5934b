"""Run the launcher as a child and pass signals on to the training processes.

Under SLURM with proctrack/cgroup only the task itself (this process) receives SIGTERM
and the --signal USR1; the training processes are its grandchildren, and torch's elastic
agent starts each of them in a session of its own. So:
- TERM, INT and HUP go to the launcher, which stops its workers with one SIGTERM each;
- USR1 and USR2 go to the child and every process below it. The launcher itself would die of
  them, so it inherits them ignored; the training processes install their own handlers.
"""

from __future__ import annotations

import signal
import subprocess

import psutil

STOP = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP)
NOTICE = (signal.SIGUSR1, signal.SIGUSR2)


def run_forwarding(argv: list[str]) -> int:
    for signum in NOTICE:
        signal.signal(signum, signal.SIG_IGN)  # inherited by the launcher
    child = subprocess.Popen(argv, start_new_session=True)

    def to_launcher(signum, _frame):
        child.send_signal(signum)

    def to_workers(signum, _frame):
        # The child too: with one process it is the trainer (a launcher ignores these).
        try:
            top = psutil.Process(child.pid)
            workers = [top, *top.children(recursive=True)]
        except psutil.NoSuchProcess:
            return
        for worker in workers:
            try:
                worker.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    for signum in STOP:
        signal.signal(signum, to_launcher)
    for signum in NOTICE:
        signal.signal(signum, to_workers)
    code = child.wait()
    return 128 - code if code < 0 else code
