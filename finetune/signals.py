"""Signals seen by a training process. For now a notice: the signal is reported with the
rank that got it, so a SLURM time-limit warning is visible in the job's log."""

from __future__ import annotations

import signal
import sys


def install_notice_handlers(rank: int) -> None:
    def notice(signum, _frame):
        print(f"finetune: rank {rank} received {signal.Signals(signum).name}", file=sys.stderr,
              flush=True)

    for signum in (signal.SIGUSR1, signal.SIGUSR2):
        signal.signal(signum, notice)
