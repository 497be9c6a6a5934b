"""Run the launcher as a child and pass signals on to the training processes.

Under SLURM with proctrack/cgroup only the task itself (this process) receives SIGTERM
and the --signal USR1; the training processes are its grandchildren, and torch's elastic
agent starts each of them in a session of its own. So every signal this process gets goes
straight to the training processes: the launcher's direct children (not their data-loader
workers, which the signals would kill), or the child itself when it is the trainer. The
launcher is left alone: torch's agent would answer SIGTERM by terminating its workers
mid-save; it ends by itself when they exit. Only while no trainer exists yet (rendezvous)
does the launcher get the signal.

A trainer that stopped on a signal after sealing a checkpoint exits 75 (130 on Ctrl-C) and rank 0
writes stopped.json; the launcher then reports a failure, so the exit code of this process
is decided here: 75 (130) when the stop was asked for and stopped.json is new. Likewise 2 when
a trainer stopped on a user error (a bad data row, a failing reward function): each one
writes failed-<rank>.json, and the launcher would only say that a child failed.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil

from finetune.errors import FAILED_MARKER, exit_code

FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGUSR1, signal.SIGUSR2)


def _trainers(child: subprocess.Popen, argv: list[str]) -> list[psutil.Process]:
    try:
        top = psutil.Process(child.pid)
        if argv[1:4] == ["-m", "finetune", "train"]:
            return [top]
        return top.children() or [top]
    except psutil.NoSuchProcess:
        return []


def _failures(run_dir: Path, since: float) -> list[Path]:
    pattern = FAILED_MARKER.replace(".json", "-*.json")
    return sorted(p for p in run_dir.glob(pattern) if p.stat().st_mtime >= since)


def run_forwarding(argv: list[str], stopped_marker: Path, run_dir: Path,
                   env_update: dict[str, str] | None = None) -> int:
    for signum in FORWARDED:
        # Ignored until our handler is set, and inherited ignored by the launcher (which
        # sets its own handlers) so that it never dies of a USR1 meant for the trainers.
        signal.signal(signum, signal.SIG_IGN)
    started = time.time()
    child = subprocess.Popen(argv, start_new_session=True,
                             env={**os.environ, **(env_update or {})})
    asked: list[str] = []

    def forward(signum, _frame):
        asked.append(signal.Signals(signum).name)
        for trainer in _trainers(child, argv):
            try:
                trainer.send_signal(signum)
            except psutil.NoSuchProcess:
                pass

    for signum in FORWARDED:
        signal.signal(signum, forward)
    code = child.wait()
    code = 128 - code if code < 0 else code
    if asked and stopped_marker.is_file() and stopped_marker.stat().st_mtime >= started:
        stopped = exit_code(asked[0])
        print(f"finetune: the training processes saved a checkpoint and stopped on {asked[0]} "
              f"({stopped_marker}); exit {stopped}. Run the same command again to "
              "continue.", file=sys.stderr, flush=True)
        return stopped
    failed = _failures(run_dir, started) if code else []
    if failed:
        print(f"finetune: a training process stopped on the error above ({failed[0]}); "
              "exit 2", file=sys.stderr, flush=True)
        return 2
    return code
