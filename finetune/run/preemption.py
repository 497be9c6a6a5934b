"""Stop on SIGTERM, SIGUSR1 (or SIGUSR2) or Ctrl-C (SIGINT) with a complete checkpoint, on
every rank together.

The handler only records the signal. At the end of each optimizer step the ranks agree
(one all-reduce of a flag) whether any of them was signalled; if so every rank asks the
Trainer to save and stop at that same step, the checkpoint is sealed (callbacks.py), and
the process exits with errors.EXIT_PREEMPTED (EXIT_INTERRUPTED, 130, after Ctrl-C, as a
shell expects of an interrupted command; either way the same command continues the run).
A second signal (a second Ctrl-C too) kills at once (the default action is restored after
the first), and a save that outlives preemption.save_timeout ends the process from a
watchdog thread; either way the previous checkpoint stays.
"""

from __future__ import annotations

import os
import signal
import sys
import threading

from transformers import TrainerCallback

from finetune.errors import EXIT_SAVE_TIMEOUT

# USR2 too: some clusters warn with it. SIGINT: Ctrl-C, how a person stops a run. Under
# `finetune launch` the trainers run in a session of their own: only the launcher gets the
# terminal's SIGINT, and passes it on to each trainer once (launch/forward.py).
SIGNALS = (signal.SIGTERM, signal.SIGUSR1, signal.SIGUSR2, signal.SIGINT)


class Preempted(Exception):
    """Training stopped on a signal after saving a complete checkpoint."""

    def __init__(self, signal_name: str, step: int, checkpoint: str | None):
        self.signal_name, self.step, self.checkpoint = signal_name, step, checkpoint
        super().__init__(f"stopped on {signal_name} at step {step}; checkpoint {checkpoint}")


class StopOnSignal(TrainerCallback):
    def __init__(self, rank: int, save_timeout: float):
        self.rank = rank
        self.save_timeout = save_timeout
        self.received: str | None = None  # the signal this process got
        self.stopping = False  # all ranks agreed to stop at this step
        self.watchdog: threading.Timer | None = None
        for signum in SIGNALS:
            signal.signal(signum, self._handle)

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        for other in SIGNALS:  # a second signal ends the process at once
            signal.signal(other, signal.SIG_DFL)
        self.received = name
        # os.write, not print: a handler may interrupt a print on the main thread.
        os.write(2, f"finetune: rank {self.rank} received {name}: saving a checkpoint at the "
                    "end of this optimizer step, then exiting (a second signal exits at "
                    "once)\n".encode())
        self._start_deadline()

    def _start_deadline(self) -> None:
        if self.watchdog is None:
            self.watchdog = threading.Timer(self.save_timeout, self._give_up)
            self.watchdog.daemon = True
            self.watchdog.start()

    def _give_up(self) -> None:
        print(f"finetune: rank {self.rank}: the save asked for by {self.received} did not "
              f"finish within {self.save_timeout:g} s (preemption.save_timeout); exiting "
              "without it, the previous complete checkpoint stays", file=sys.stderr, flush=True)
        os._exit(EXIT_SAVE_TIMEOUT)

    def _anyone_signalled(self, device) -> bool:
        import torch
        import torch.distributed as dist

        local = self.received is not None
        if not (dist.is_available() and dist.is_initialized()):
            return local
        flag = torch.tensor([1.0 if local else 0.0], device=device)
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())

    def on_step_end(self, args, state, control, **kwargs):
        if not self.stopping and self._anyone_signalled(args.device):
            # A rank stopping because another was signalled keeps its handlers: its own
            # copy of the signal may still be on the way, and is not a second one.
            self.stopping = True
            self._start_deadline()
            control.should_save = True
            control.should_training_stop = True
        return control

    def done(self) -> None:
        """The save finished (or training ended): no more deadline."""
        if self.watchdog is not None:
            self.watchdog.cancel()
