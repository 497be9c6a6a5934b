"""Run a sweep's trials one after another, each a `finetune train` (or `launch`) subprocess
in its own run directory, and keep the sweep's record (sweep.json, written whole or not at
all) so that the same command continues a stopped or killed sweep.

Signals: SIGTERM, SIGUSR1, SIGUSR2 (and SIGINT, SIGHUP, passed on as SIGTERM) go to the
running trial, which saves a checkpoint and exits 75; the sweep then exits 75 too. The
trial runs in a session of its own, so a signal to the whole process group reaches it once,
through the sweep. On Linux a trial whose sweep is killed outright gets SIGTERM (the
parent-death signal), saves and stops; the rerun waits for it to finish saving."""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any, Callable

from finetune.fileio.atomic import write_atomic
from finetune.errors import EXIT_PREEMPTED, ConfigError, RunError
from finetune.sweep.spec import Sweep

STATE = "sweep.json"
DONE = ("finished", "failed", "pruned")  # a rerun keeps these as they are
SIGNALS = {signal.SIGTERM: signal.SIGTERM, signal.SIGUSR1: signal.SIGUSR1,
           signal.SIGUSR2: signal.SIGUSR2, signal.SIGINT: signal.SIGTERM,
           signal.SIGHUP: signal.SIGTERM}
POLL_SECONDS = 1.0


class Stopped(Exception):
    """The sweep was asked to stop (a signal): its state is saved, the command exits 75."""


def save(sweep_dir: Path, state: dict[str, Any]) -> None:
    write_atomic(sweep_dir / STATE, json.dumps(state, indent=1) + "\n")


def load(sweep_dir: Path) -> dict[str, Any] | None:
    path = sweep_dir / STATE
    try:
        state = json.loads(path.read_text())
    except FileNotFoundError:
        return None
    except (OSError, ValueError) as exc:
        raise RunError(f"{path}: damaged ({exc}); it is the sweep's record of its trials. "
                       "Nothing was changed: restore it, or choose another --out") from None
    if not isinstance(state, dict) or not isinstance(state.get("trials"), list):
        raise RunError(f"{path}: not a sweep record; nothing was changed")
    return state


def check_same(state: dict[str, Any], identity: dict[str, Any], sweep_dir: Path) -> None:
    """A rerun continues only the same sweep: same experiment file, overrides and sweep
    (as validated). Anything else would mix trials of two searches in one table."""
    changed = [key for key in identity if state.get(key) != identity[key]]
    if changed:
        raise ConfigError([f"{sweep_dir / STATE}: this sweep directory holds a sweep started "
                           f"with a different {' and '.join(changed)}; nothing was changed. "
                           "Rerun it with what it was started with, or give --out a new "
                           "directory for a new sweep"])


def wait_for_leftover(trial: dict[str, Any]) -> None:
    """A trial still running from a sweep that was killed: wait until it has saved and
    exited before its run directory is used again."""
    pid = trial.get("pid")
    if not pid:
        return
    import psutil

    try:
        process = psutil.Process(pid)
        mine = trial["run_dir"] in " ".join(process.cmdline())
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return
    if mine:
        print(f"finetune: {trial['name']} is still running from the stopped sweep (pid {pid}); "
              "waiting for it to exit", flush=True)
        process.wait()


class Trial:
    """One trial's subprocess, with the sweep's signals passed on to it."""

    def __init__(self, argv: list[str]):
        self.argv = argv
        self.asked: str | None = None  # the signal the sweep got while it ran
        self.pruned = False
        self.child: subprocess.Popen | None = None

    def start(self) -> int:
        self.child = subprocess.Popen(self.argv, start_new_session=True,
                                      preexec_fn=_parent_death_signal())
        return self.child.pid

    def stop(self, why_pruned: bool = False) -> None:
        self.pruned = self.pruned or why_pruned
        if self.child is not None and self.child.poll() is None:
            self.child.send_signal(signal.SIGTERM)

    def wait(self, watch: Callable[["Trial"], None]) -> int:
        while True:
            try:
                code = self.child.wait(timeout=POLL_SECONDS)
                return 128 - code if code < 0 else code
            except subprocess.TimeoutExpired:
                watch(self)


def _parent_death_signal() -> Callable[[], None] | None:
    """What the child runs before exec (Linux): SIGTERM when the sweep dies, so the trial
    saves and stops instead of running on unowned. libc is found here, in the parent."""
    if not sys.platform.startswith("linux"):
        return None
    import ctypes

    prctl = ctypes.CDLL(None, use_errno=True).prctl
    PR_SET_PDEATHSIG = 1
    return lambda: prctl(PR_SET_PDEATHSIG, int(signal.SIGTERM))


class Signals:
    """While the sweep runs, its signals are recorded and passed on to the running trial."""

    def __init__(self) -> None:
        self.received: str | None = None
        self.trial: Trial | None = None

    def __enter__(self) -> "Signals":
        self.previous = {s: signal.signal(s, self._handle) for s in SIGNALS}
        return self

    def __exit__(self, *exc) -> None:
        for s, handler in self.previous.items():
            signal.signal(s, handler)

    def _handle(self, signum, _frame) -> None:
        name = signal.Signals(signum).name
        os.write(2, f"finetune: sweep received {name}: stopping the running trial (it saves "
                    "a checkpoint), then exiting\n".encode())
        self.received = self.received or name
        trial = self.trial
        if trial is not None and trial.child is not None and trial.child.poll() is None:
            trial.asked = name
            trial.child.send_signal(SIGNALS[signum])


def metric_of(run_dir: Path, metric: str) -> float | None:
    """The metric from the run's summary.json: a bare name (eval_loss) is the evaluation
    after training; before/NAME, after/NAME and train/NAME name the part."""
    try:
        summary = json.loads((run_dir / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    part, _, name = metric.rpartition("/")
    found = (summary.get(part or "after") or {}).get(name) if isinstance(summary, dict) else None
    return float(found) if isinstance(found, (int, float)) and not isinstance(found, bool) \
        else None


def logged_metric(run_dir: Path, metric: str) -> dict[int, float]:
    """The metric at each evaluation during training (metrics.jsonl), by step."""
    from finetune.rundir.paths import metrics_records

    records, _ = metrics_records(run_dir / "metrics.jsonl")
    return {r["step"]: float(r[metric]) for r in records
            if isinstance(r.get(metric), (int, float)) and not isinstance(r[metric], bool)}


def should_prune(sweep: Sweep, trials: list[dict[str, Any]], values: dict[int, float]) -> bool:
    """Optuna's MedianPruner rule: at the latest evaluation step, the trial's best value so
    far is worse than the median of the finished trials' values at that step."""
    if sweep.prune is None or not values:
        return False
    step = max(values)
    if step < sweep.prune.warmup_steps:
        return False
    others = [t["intermediate"][str(step)] for t in trials
              if t["status"] == "finished" and str(step) in (t.get("intermediate") or {})]
    if len(others) < sweep.prune.min_trials:
        return False
    pick = min if sweep.goal == "minimize" else max
    best, median = pick(values.values()), statistics.median(others)
    return best > median if sweep.goal == "minimize" else best < median


def run_trial(trial: dict[str, Any], argv: list[str], sweep: Sweep, state: dict[str, Any],
              sweep_dir: Path, signals: Signals) -> None:
    """Run (or resume) one trial to its end, recording it in state; Stopped on a signal."""
    run_dir = Path(trial["run_dir"])
    process = Trial(argv)
    signals.trial = process
    trial["status"] = "running"
    trial["pid"] = process.start()
    save(sweep_dir, state)
    if signals.received:  # arrived between the save and the start
        process.stop()

    def watch(running: Trial) -> None:
        if sweep.prune is None or running.pruned:
            return
        values = logged_metric(run_dir, sweep.metric)
        trial["intermediate"] = {str(step): v for step, v in sorted(values.items())}
        if should_prune(sweep, state["trials"], values):
            print(f"finetune: pruning {trial['name']} at step {max(values)}: {sweep.metric} "
                  "worse than the median of the finished trials there", flush=True)
            running.stop(why_pruned=True)

    code = process.wait(watch)
    signals.trial = None
    trial["pid"], trial["exit_code"] = None, code
    if sweep.prune is not None:
        values = logged_metric(run_dir, sweep.metric)
        trial["intermediate"] = {str(step): v for step, v in sorted(values.items())}
    if process.pruned and not signals.received:
        trial["status"] = "pruned"
        values = trial.get("intermediate") or {}
        trial["metric"] = list(values.values())[-1] if values else None
    elif code == 0:
        trial["metric"] = metric_of(run_dir, sweep.metric)
        trial["status"] = "finished" if trial["metric"] is not None else "failed"
        if trial["metric"] is None:
            print(f"finetune: warning: {trial['name']}: no {sweep.metric} in "
                  f"{run_dir / 'summary.json'}; the trial counts as failed", file=sys.stderr)
    elif code == EXIT_PREEMPTED or signals.received:
        trial["status"] = "stopped"
    else:
        trial["status"] = "failed"
    save(sweep_dir, state)
    if trial["status"] == "stopped":
        raise Stopped(f"{trial['name']} stopped (exit {code}) on "
                      f"{signals.received or 'a signal sent to it'}")
