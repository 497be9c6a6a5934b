"""The run bundle: every file a launch uses, written where the user can read and reuse
it. The worker rebuilds the same values from the experiment, so the files are a record
and a way to launch with the ecosystem's own tools, never a second source of truth."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from finetune.config.schema import Experiment
from finetune.errors import RunError
from finetune.launch.command import launch_script, script_safe
from finetune.render.accelerate import accelerate_config
from finetune.render.deepspeed import deepspeed_dict
from finetune.rundir import make_run_dir, resolved_yaml


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
