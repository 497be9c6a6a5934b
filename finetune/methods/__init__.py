"""Training methods: each builds its trainer from a Job, registered by name."""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from finetune.build.data import Splits
from finetune.build.device import Hardware
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


def _registry() -> dict[str, Callable[[Job], Any]]:
    from finetune.methods import dpo, reward, sft

    return {"sft": sft.build_trainer, "reward": reward.build_trainer, "dpo": dpo.build_trainer}


def build_trainer(job: Job) -> Any:
    return _registry()[job.experiment.method](job)
