"""Training methods: each builds its trainer from a Job, registered by name."""

from __future__ import annotations

import importlib

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from finetune.data.load import Splits
from finetune.hardware import Hardware
from finetune.config.schema import Experiment


@dataclass
class Job:
    """Everything a method needs, built once per rank by the worker."""

    experiment: Experiment
    run_dir: Path
    hardware: Hardware
    tokenizer: Any
    model: Any
    data: Splits
    args: Any  # the method's TRL config instance
    callbacks: list = field(default_factory=list)
    notes: list[str] = field(default_factory=list)  # decisions the start summary reports


# method -> module of finetune.methods with a build_trainer(job); imported on use, so a
# run pays only for its own method's imports.
METHODS = {"sft": "sft", "reward": "reward", "dpo": "dpo", "classify": "classify",
           "grpo": "grpo", "ppo": "ppo"}


def build_trainer(job: Job) -> Any:
    module = importlib.import_module(f"finetune.methods.{METHODS[job.experiment.method]}")
    return module.build_trainer(job)
