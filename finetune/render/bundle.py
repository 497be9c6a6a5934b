"""The run bundle: every file a launch uses, written where the user can read and reuse
it. The worker rebuilds the same values from the experiment, so the files are a record
and a way to launch with the ecosystem's own tools, never a second source of truth.
prepare_run_dir decides where a run starts and writes the bundle of the run directory."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import yaml

from finetune import __version__
from finetune.config.schema import Experiment
from finetune.config.secrets import redact
from finetune.errors import RunError
from finetune.render.accelerate import accelerate_config
from finetune.config.derived.deepspeed import deepspeed_dict
from finetune.render.scripts import launch_script, script_safe
from finetune.rundir.resume import ResumePlan, plan_resume
from finetune.rundir.paths import check_entries, check_run_dir, make_run_dir, run_dir_of


def write_file(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    try:
        tmp.write_text(text)
        tmp.replace(path)
    except OSError as exc:  # e.g. a directory where the file should be, a full disk
        tmp.unlink(missing_ok=True)
        raise RunError(f"cannot write {path}: {exc.strerror}") from None


def _check_values(value, where: str) -> None:
    """Every string of a generated config is free of control characters."""
    if isinstance(value, dict):
        for key, sub in value.items():
            _check_values(sub, f"{where}: {key}")
    elif isinstance(value, list):
        for sub in value:
            _check_values(sub, where)
    elif isinstance(value, str):
        script_safe(value, where)


def write_bundle(experiment: Experiment, out_dir: Path) -> list[Path]:
    make_run_dir(out_dir)
    files = {"experiment.yaml": resolved_yaml(experiment)}
    ds_file = None
    if experiment.distributed.strategy == "deepspeed":
        ds_file = out_dir / "deepspeed.json"
        ds_config = deepspeed_dict(experiment)
        _check_values(ds_config, "deepspeed.json")
        files["deepspeed.json"] = json.dumps(ds_config, indent=2) + "\n"
    accelerate = accelerate_config(experiment, str(ds_file) if ds_file else None)
    _check_values(accelerate, "accelerate.yaml")
    files["accelerate.yaml"] = yaml.safe_dump(accelerate, sort_keys=False)
    files["launch.sh"] = launch_script(experiment, out_dir)
    for name, text in files.items():
        write_file(out_dir / name, text)
    (out_dir / "launch.sh").chmod(0o755)
    return [out_dir / name for name in files]


def resolved_yaml(experiment: Experiment) -> str:
    body = redact(experiment.model_dump(mode="json"))
    header = f"# resolved by finetune {__version__}; secrets redacted\n"
    return header + yaml.safe_dump(body, sort_keys=False, allow_unicode=True)


def prepare_run_dir(experiment: Experiment, rank: int = 0) -> tuple[Experiment, Path, ResumePlan]:
    """Fix the run directory (and a resume path) in the experiment, decide where training
    starts, and on rank 0 write the run bundle. Nothing already in the directory is
    overwritten unless the run continues from it (see resume.py)."""
    run_dir = run_dir_of(experiment)
    check_run_dir(run_dir)
    update: dict[str, Any] = {"output": experiment.output.model_copy(update={"dir": str(run_dir)})}
    if experiment.resume not in ("auto", "never"):
        update["resume"] = str(Path(experiment.resume).absolute())
    experiment = experiment.model_copy(update=update)
    plan = plan_resume(experiment, run_dir)  # a finished run is done, whatever is there
    check_entries(run_dir)
    if rank == 0:
        write_bundle(experiment, run_dir)
    make_run_dir(run_dir)
    return experiment, run_dir, plan
