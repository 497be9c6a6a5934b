"""The experiment trackers of training.report_to, kept to one run per experiment.

transformers' integrations log what the Trainer logs (losses, learning rate, eval_*), and
each of them makes its own choices: TensorBoard writes under checkpoints/runs/<time>,
MLflow ends its run when training ends (the evaluation after training then lands in a new,
unnamed run), and neither knows that an attempt continues an earlier one. So finetune
starts the runs itself, by their documented interfaces, before the Trainer exists:

- TensorBoard: RUN_DIR/tensorboard/ (TENSORBOARD_LOGGING_DIR, which the callback reads;
  TrainingArguments has no logging_dir in transformers 5). A resumed attempt marks the
  step it continues from, and TensorBoard drops what the stopped attempt logged after it.
- MLflow: the run is finetune's active run (mlflow.start_run), which MLflowCallback logs
  into and leaves open; its id is kept in RUN_DIR/trackers.json and resumed by the next
  attempt. Runs go where MLFLOW_TRACKING_URI (and MLFLOW_EXPERIMENT_NAME) say.
- W&B: wandb.init with an id kept in trackers.json, resume="allow"; files under
  WANDB_DIR, else RUN_DIR/wandb/.

What the Trainer does not log reaches them here too: exact match as it is measured
(`log`), and once trained the summary's numbers and the run's files (`finish`).
Only the main process tracks; every process sets the TensorBoard directory.
"""

from __future__ import annotations

import json
import os
import sys
import time
import uuid
from pathlib import Path
from typing import Any

from finetune.fileio.atomic import write_atomic
from finetune.config.rules.integrations import reported
from finetune.config.schema import Experiment
from finetune.config.secrets import scrub
from finetune.errors import RunError, first_line
from finetune.report.summary import summary_metrics

STATE = "trackers.json"
TENSORBOARD = "tensorboard"
# Run files each tracker keeps, those that exist (plots: *.png).
FILES = ("experiment.yaml", "summary.json", "environment.json")


def _summary_writer():
    try:
        from torch.utils.tensorboard import SummaryWriter
    except ImportError:  # transformers falls back to tensorboardX the same way
        from tensorboardX import SummaryWriter
    return SummaryWriter


def _read_state(run_dir: Path) -> dict[str, Any]:
    try:
        state = json.loads((run_dir / STATE).read_text())
    except (OSError, ValueError):
        return {}
    return state if isinstance(state, dict) else {}


def _say(text: str) -> None:
    print(f"finetune: {text}", flush=True)


class Tracking:
    """The runs this attempt logs into (main process; elsewhere it holds none)."""

    def __init__(self, run_dir: Path, names: list[str]):
        self.run_dir = run_dir
        self.names = names
        self.mlflow_run_id: str | None = None
        self.wandb_run = None
        self._writer = None  # TensorBoard, for what the Trainer does not log

    # Starting

    def start_mlflow(self, name: str, saved: dict[str, Any]) -> dict[str, Any]:
        import mlflow

        run = None
        if saved.get("run_id"):
            try:
                run = mlflow.start_run(run_id=saved["run_id"])
            except mlflow.exceptions.MlflowException:
                _say(f"mlflow: run {saved['run_id']} of the stopped attempt is not in "
                     f"{mlflow.get_tracking_uri()}; starting a new run")
        if run is None:
            run = mlflow.start_run(run_name=name)
        self.mlflow_run_id = run.info.run_id
        _say(f"mlflow: run {run.info.run_id} (experiment {run.info.experiment_id})")
        return {"run_id": run.info.run_id, "experiment_id": run.info.experiment_id}

    def start_wandb(self, name: str, saved: dict[str, Any]) -> dict[str, Any]:
        import wandb

        run_id = saved.get("run_id") or uuid.uuid4().hex[:12]
        self.wandb_run = wandb.init(id=run_id, resume="allow", name=name,
                                    dir=os.environ.get("WANDB_DIR") or str(self.run_dir))
        return {"run_id": run_id}

    def mark_tensorboard_start(self, step: int | None) -> None:
        """A session start at `step`: TensorBoard forgets the events logged at or after it
        before (by a stopped attempt past its checkpoint; from scratch: everything)."""
        self._writer = _summary_writer()(str(self.run_dir / TENSORBOARD), purge_step=step)
        self._writer.flush()

    # Logging

    def log(self, record: dict[str, Any]) -> None:
        """A metrics.jsonl record the Trainer did not log (exact match): its eval_ numbers
        at its step, named as each integration names the Trainer's."""
        step = record["step"]
        values = {k: v for k, v in record.items() if k.startswith("eval_")
                  and isinstance(v, (int, float)) and not isinstance(v, bool)}
        if not values:
            return
        if self._writer is not None:
            for key, value in values.items():
                self._writer.add_scalar(key.replace("eval_", "eval/", 1), value, step)
            self._writer.flush()
        if self.mlflow_run_id:
            import mlflow

            mlflow.log_metrics(values, step=step)
        if self.wandb_run is not None:
            self.wandb_run.log({**{k.replace("eval_", "eval/", 1): v for k, v in values.items()},
                                "train/global_step": step})

    def finish(self, summary: dict[str, Any]) -> None:
        """The summary's numbers and the run's files into each run, then end it. The run
        is complete by now: a tracker failing here is a warning, not an error."""
        try:
            self._finish(summary)
        except Exception as exc:  # a tracking server gone away, say
            print(f"finetune: warning: the trackers did not get the summary: "
                  f"{scrub(first_line(exc))}", file=sys.stderr, flush=True)

    def _finish(self, summary: dict[str, Any]) -> None:
        numbers, step = summary_metrics(summary), summary.get("global_step", 0)
        files = [self.run_dir / n for n in FILES] + sorted(self.run_dir.glob("*.png"))
        files = [f for f in files if f.is_file()]
        if self._writer is not None:
            for key, value in numbers.items():
                self._writer.add_scalar(f"summary/{key}", value, step)
            self._writer.add_text("summary", json.dumps(summary, indent=2, default=str), step)
        if self.mlflow_run_id:
            import mlflow

            mlflow.log_metrics({f"summary/{k}": v for k, v in numbers.items()}, step=step)
            for path in files:
                mlflow.log_artifact(str(path))
        if self.wandb_run is not None:
            self.wandb_run.summary.update(numbers)
            for path in files:
                self.wandb_run.save(str(path), base_path=str(self.run_dir), policy="now")
        self.end("FINISHED")

    def end(self, status: str) -> None:
        """Close what is open: `status` for the MLflow run (KILLED when stopped by a
        signal: the next attempt resumes it), the W&B run marked failed unless FINISHED."""
        if self._writer is not None:
            self._writer.close()
            self._writer = None
        if self.mlflow_run_id:
            import mlflow

            mlflow.flush_async_logging()  # MLflowCallback logs asynchronously
            active = mlflow.active_run()
            if active is not None and active.info.run_id == self.mlflow_run_id:
                mlflow.end_run(status)
            self.mlflow_run_id = None
        if self.wandb_run is not None:
            self.wandb_run.finish(exit_code=0 if status == "FINISHED" else 1)
            self.wandb_run = None


def start(experiment: Experiment, run_dir: Path, resume_step: int | None,
          main: bool) -> Tracking:
    """Before the Trainer is built. resume_step: the checkpoint's step this attempt
    continues from (None: from scratch, in new runs)."""
    names = reported(experiment.training)
    tracking = Tracking(run_dir, names)
    if "tensorboard" in names:
        os.environ["TENSORBOARD_LOGGING_DIR"] = str(run_dir / TENSORBOARD)
    if not main:
        return tracking
    if "tensorboard" in names:
        tracking.mark_tensorboard_start(resume_step + 1 if resume_step is not None else 0)
    saved = _read_state(run_dir) if resume_step is not None else {}
    state: dict[str, Any] = {}
    starts = {"mlflow": tracking.start_mlflow, "wandb": tracking.start_wandb}
    for name in [n for n in names if n in starts]:
        try:
            state[name] = starts[name](experiment.name, saved.get(name) or {})
        except Exception as exc:  # a server that cannot be reached, a refused key
            tracking.end("FAILED")
            raise RunError(f"{name}: cannot start the run: {scrub(first_line(exc))} "
                           "(training.report_to; nothing was trained)") from None
    if state:
        state["time"] = round(time.time(), 3)
        write_atomic(run_dir / STATE, json.dumps(state, indent=2) + "\n")
    return tracking
