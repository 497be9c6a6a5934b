"""Training methods: each module prepares its rows and builds its trainer from a Job; its
record (config/methods.py) names the module."""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType
from typing import Any, Callable

from finetune.config.methods import method
from finetune.config.schema import Experiment
from finetune.data.load import Splits
from finetune.model.hardware import Hardware


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


def _module(experiment: Experiment) -> ModuleType:
    """The method's module (its record names it), imported on use: a run pays only for
    its own method's imports."""
    return importlib.import_module(method(experiment.method).module)


def preparation(experiment: Experiment) -> Callable | None:
    """The method's prepare(splits, tokenizer, experiment), which data/prepare.py runs on
    the validated rows (None: the rows are used as read)."""
    return getattr(_module(experiment), "prepare", None)


def build_trainer(job: Job) -> Any:
    return _module(job.experiment).build_trainer(job)
