"""Trainer callbacks: every log and eval event appended to metrics.jsonl (main process),
and every checkpoint sealed with a manifest once all ranks have written it."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path
from typing import Any

from transformers import TrainerCallback

from finetune import checkpoints
from finetune.preemption import StopOnSignal


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsFile(TrainerCallback):
    def __init__(self, path: Path):
        self.path = path

    def write(self, record: dict) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.write({"step": state.global_step, "epoch": state.epoch,
                        "time": round(time.time(), 3), **logs})


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def truncate_metrics(path: Path, step: int) -> None:
    """Resuming from checkpoint-<step>: forget what an attempt logged after it, and the
    end-of-attempt records at it (train_runtime summary, evaluation after), so the file
    reads like one uninterrupted run."""
    if not path.exists():
        return
    kept = [r for r in read_metrics(path)
            if r.get("step", 0) < step or (r.get("step") == step and "train_runtime" not in r
                                            and r.get("when") != "after")]
    checkpoints.write_atomic(path, "".join(json.dumps(r) + "\n" for r in kept))


def _barrier() -> None:
    import torch.distributed as dist

    if dist.is_available() and dist.is_initialized():
        dist.barrier()


class LossWindow(TrainerCallback):
    """The Trainer logs the mean loss of the steps since its last log, and a resumed
    Trainer starts that window afresh: stopped at step 7 with logging_steps 5, its log at
    step 10 would average steps 8-10, not 6-10. So every checkpoint keeps each rank's open
    window (loss sum and first step), and a resume reopens it: every logged loss equals
    the uninterrupted run's. This reads and sets two private Trainer attributes
    (_tr_loss, _globalstep_last_logged); tests/test_resume.py fails if they change."""

    def __init__(self, resume_from: Path | None):
        self.resume_from = resume_from
        self.trainer = None  # set once the trainer exists

    @staticmethod
    def _file(checkpoint: Path, rank: int) -> Path:
        return checkpoint / f"loss_window_{rank}.pt"

    def on_save(self, args, state, control, **kwargs):
        import torch

        checkpoint = checkpoints.directory(args.output_dir, state.global_step)
        torch.save({"sum": self.trainer._tr_loss.detach().cpu().clone(),
                    "since": self.trainer._globalstep_last_logged},
                   self._file(checkpoint, args.process_index))

    def on_train_begin(self, args, state, control, **kwargs):
        import torch

        if self.resume_from is None:
            return
        saved = self._file(self.resume_from, args.process_index)
        if not saved.is_file():  # another number of processes: a fresh window
            return
        window = torch.load(saved, weights_only=True)
        self.trainer._tr_loss = window["sum"].to(self.trainer._tr_loss.device)
        self.trainer._globalstep_last_logged = int(window["since"])


class SealCheckpoints(TrainerCallback):
    """After the Trainer wrote checkpoint-<step> (on every rank), rank 0 writes its
    manifest, then deletes checkpoints beyond save_total_limit: only sealed ones, never
    the newest. Rotation is ours, not the Trainer's, whose rotation runs before a
    checkpoint is sealed and could leave nothing complete to resume from."""

    def __init__(self, run_dir: Path, manifest_extra: dict[str, Any], save_total_limit: int | None,
                 stop: StopOnSignal):
        self.run_dir = run_dir
        self.extra = manifest_extra
        self.limit = save_total_limit
        self.stop = stop

    def on_save(self, args, state, control, **kwargs):
        checkpoint = checkpoints.directory(args.output_dir, state.global_step)
        _barrier()  # every rank's files (shards, RNG states) are written
        if state.is_world_process_zero:
            extra = dict(self.extra)
            if self.stop.stopping:
                extra["saved_on"] = self.stop.received or "a signal on another rank"
            checkpoints.write_manifest(checkpoint, state.global_step, extra)
            if self.stop.stopping:
                checkpoints.write_atomic(self.run_dir / checkpoints.STOPPED, json.dumps(
                    {"step": state.global_step, "checkpoint": str(checkpoint),
                     "signal": extra["saved_on"], "time": round(time.time(), 3)}) + "\n")
            best = state.best_model_checkpoint
            checkpoints.rotate(Path(args.output_dir), self.limit,
                               {Path(best).resolve()} if best else set())
        _barrier()  # no rank exits before the checkpoint is sealed
        if self.stop.stopping:
            self.stop.done()
        return control
