"""The run directory: where a run's resolved experiment, environment, metrics, checkpoints
and final model live. Torch-free; the worker adds what needs torch (environment.json).

runs/<name>/
  experiment.yaml    the resolved experiment, every default filled, secrets redacted
  accelerate.yaml    the Accelerate config of the launch (accelerate's own format)
  deepspeed.json     the DeepSpeed config, with strategy deepspeed
  launch.sh          the exact launch command of each machine: bash launch.sh RANK
  environment.json   package versions, python, platform, device (written by the worker)
  training_args.json the TRL config the trainer ran with (written by the worker)
  metrics.jsonl      one JSON object per log/eval event
  summary.json       metrics before and after training, where the model is
  loss.png           the loss curve
  tensorboard/       TensorBoard event files (training.report_to tensorboard)
  wandb/             W&B's files of the run (report_to wandb, WANDB_DIR unset)
  trackers.json      the MLflow and W&B run ids, resumed by the next attempt
  checkpoints/       checkpoint-<step>/ written by the Trainer, sealed by a manifest
                     (damaged ones moved aside to damaged-checkpoint-<step>/)
  stopped.json       where the last attempt stopped on a signal (step, checkpoint)
  failed-<rank>.json the error a training process stopped on (read by finetune launch)
  final/             the final model or adapter, with its tokenizer (a random-init
                     adapter: with init-model/'s files hard-linked beside it)
  init-model/        the starting weights of a model.init: random run
  merged/            the adapter merged into its base (`finetune merge`)
  eval/              results of `finetune eval` (commands/eval.py), one JSON file each
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from finetune.config.schema import Experiment
from finetune.config.script_values import control_problem
from finetune.config.secrets import CREDENTIALS
from finetune.errors import RunError

# What finetune writes there, by kind (the list above): one of the wrong kind (a directory
# where a file goes, say) would fail a write halfway through a run, so it is refused first.
FILES = ("experiment.yaml", "accelerate.yaml", "deepspeed.json", "launch.sh", "job.sbatch",
         "environment.json", "training_args.json", "metrics.jsonl", "summary.json", "loss.png",
         "stopped.json", "trackers.json")
DIRECTORIES = ("checkpoints", "final", ".final.partial", "init-model", "tensorboard", "wandb")


def run_dir_of(experiment: Experiment) -> Path:
    return Path(experiment.output.dir or Path("runs") / experiment.name).absolute()


def _limit(path: Path, name: str, default: int) -> int:
    try:
        return os.pathconf(path, name)
    except (OSError, ValueError):
        return default


def check_run_dir(run_dir: Path) -> None:
    """One clear error for a run directory that cannot be one, before anything reads or
    writes there: a control character, a name too long for the file system, or a file
    where the directory (or one above it) should be."""
    text = str(run_dir)
    problem = control_problem(text)
    if problem:
        raise RunError(f"run directory {text!r} {problem} (output.dir)")
    try:
        text.encode("utf-8")  # it is written into launch.sh, job.sbatch, accelerate.yaml
    except UnicodeEncodeError:
        raise RunError(f"run directory {text!r} is not UTF-8 text (a byte the file system "
                       "name has that no character is); choose another output.dir or "
                       "working directory") from None
    if CREDENTIALS.search(text):
        raise RunError("the run directory holds credentials in a URL (user:password@), which "
                       "would be written into its files and logs; choose another output.dir")
    existing = next(p for p in (run_dir, *run_dir.parents) if os.path.lexists(p))
    name_max = _limit(existing, "PC_NAME_MAX", 255)
    long = next((part for part in run_dir.parts if len(os.fsencode(part)) > name_max), None)
    if long is not None:
        raise RunError(f"run directory {text[:60]}...: a name in it ({long[:20]}...) is "
                       f"{len(os.fsencode(long))} bytes, more than the {name_max} the file "
                       "system allows (output.dir, or name for runs/<name>)")
    path_max = _limit(existing, "PC_PATH_MAX", 4096)
    # Room for the longest file written inside (checkpoints/checkpoint-N/...).
    if len(os.fsencode(text)) + 128 > path_max:
        raise RunError(f"run directory {text[:60]}... is {len(os.fsencode(text))} bytes long; "
                       f"with the files inside it, paths would pass the system's {path_max} "
                       "(output.dir)")
    if existing.is_dir():
        return
    if existing == run_dir:
        raise RunError(f"run directory {text} is a file, not a directory (output.dir)")
    raise RunError(f"run directory {text} would be inside {existing}, which is a file, "
                   "not a directory (output.dir)")


def _kind(path: Path) -> str:
    if path.is_dir():
        return "a directory"
    if path.is_file():
        return "a file"
    return "a broken link" if path.is_symlink() and not path.exists() else "a special file"


def check_entries(run_dir: Path) -> None:
    """One error naming every entry of the wrong kind, before anything is written."""
    wrong = [f"{name} is {_kind(run_dir / name)}, not a file" for name in FILES
             if os.path.lexists(run_dir / name) and not (run_dir / name).is_file()]
    wrong += [f"{name} is {_kind(run_dir / name)}, not a directory" for name in DIRECTORIES
              if os.path.lexists(run_dir / name) and not (run_dir / name).is_dir()]
    if wrong:
        raise RunError(f"run directory {run_dir}: {'; '.join(wrong)}. finetune writes there "
                       "itself; nothing was changed. Move those away (or put back what "
                       "finetune wrote) and run again.")


def make_run_dir(run_dir: Path) -> None:
    check_run_dir(run_dir)
    try:
        run_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:  # permissions, a read-only or full file system
        raise RunError(f"cannot create the run directory {run_dir}: {exc.strerror} "
                       "(output.dir)") from None


def metrics_records(path: Path) -> tuple[list[dict], list[str]]:
    """metrics.jsonl's records, and why each line that is not one was dropped: a line must
    be a JSON object with a step number. A kill mid-append leaves a half-written last line."""
    try:
        lines = path.read_text(errors="replace").split("\n")
    except FileNotFoundError:
        return [], []
    except OSError as exc:  # a directory where the file should be, say
        raise RunError(f"cannot read {path} ({exc.strerror}): it should be the file of "
                       "logged metrics; move it away and run again") from None
    records, dropped = [], []
    for number, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except (ValueError, RecursionError):
            record = None
        step = record.get("step") if isinstance(record, dict) else None
        if isinstance(step, int) and not isinstance(step, bool) and step >= 0:
            records.append(record)
        else:
            why = "half-written, as a kill mid-append leaves it" if number == len(lines) \
                else "not a JSON object with a step number"
            dropped.append(f"{path} line {number}: {why}; dropped")
    return records, dropped
