"""The run bundle: every file a launch uses, written where the user can read and reuse
it. The worker rebuilds the same values from the experiment, so the files are a record
and a way to launch with the ecosystem's own tools, never a second source of truth."""

from __future__ import annotations

import json
import os
from pathlib import Path

import yaml

from finetune.config.schema import Experiment
from finetune.launch.command import launch_script
from finetune.render.accelerate import accelerate_config
from finetune.render.deepspeed import deepspeed_dict
from finetune.rundir import resolved_yaml


def _write(path: Path, text: str) -> None:
    """Write via a temporary file and rename, so a reader never sees half a file."""
    tmp = path.with_name(f".{path.name}.tmp{os.getpid()}")
    tmp.write_text(text)
    tmp.replace(path)


def write_bundle(experiment: Experiment, out_dir: Path) -> list[Path]:
    out_dir.mkdir(parents=True, exist_ok=True)
    files = {"experiment.yaml": resolved_yaml(experiment)}
    ds_file = None
    if experiment.distributed.strategy == "deepspeed":
        ds_file = out_dir / "deepspeed.json"
        files["deepspeed.json"] = json.dumps(deepspeed_dict(experiment), indent=2) + "\n"
    files["accelerate.yaml"] = yaml.safe_dump(
        accelerate_config(experiment, str(ds_file) if ds_file else None), sort_keys=False)
    files["launch.sh"] = launch_script(experiment, out_dir)
    for name, text in files.items():
        _write(out_dir / name, text)
    (out_dir / "launch.sh").chmod(0o755)
    return [out_dir / name for name in files]
