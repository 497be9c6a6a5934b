"""Each rank checks that it was started the way the experiment says, before training:
some launches exit 0 while running one process, or N independent copies (STACK_NOTES), and
an Accelerate config can silently change precision or turn on DeepSpeed."""

from __future__ import annotations

from pathlib import Path
from typing import Mapping

from finetune.config import deepspeed_file
from finetune.config.schema import Experiment
from finetune.config.effective import value
from finetune.render.accelerate import MIXED_PRECISION

_TRUE = ("1", "true", "yes")


def rank_of(env: Mapping[str, str]) -> int:
    return int(env.get("RANK", "0"))


def parallel_note(experiment: Experiment, device: str) -> str | None:
    """Said at the start of a run whose processes train as DDP although no strategy was
    asked for: `--num-processes N` (or num_processes) with strategy none."""
    dist = experiment.distributed
    if dist.strategy != "none" or dist.world_size == 1:
        return None
    return (f"{dist.world_size} processes with distributed.strategy none: data parallel "
            f"(DDP) on {device}")


def launch_problems(experiment: Experiment, env: Mapping[str, str], precision: str) -> list[str]:
    """What in the launch environment disagrees with the experiment (torch-free)."""
    dist = experiment.distributed
    problems = []
    world = int(env.get("WORLD_SIZE", "1"))
    if world != dist.world_size:
        problems.append(
            f"this process was started as one of {world} (WORLD_SIZE={world}), but the "
            f"experiment asks for {dist.world_size} (distributed.num_processes / "
            "processes_per_machine x num_machines); start it with `finetune launch`")
    # With bf16 and fp16 off, TrainingArguments takes the launcher's mixed precision: an
    # Accelerate file saying bf16 would silently turn an fp32 experiment into bf16. A file
    # saying 'no' changes nothing (the experiment's bf16/fp16 flags win).
    launched = env.get("ACCELERATE_MIXED_PRECISION", "no")
    if launched != "no" and launched != MIXED_PRECISION[precision]:
        problems.append(f"the Accelerate launch says mixed_precision {launched!r}, but the "
                        f"experiment's precision is {precision}; set it in one place: precision")
    for name, strategy in (("ACCELERATE_USE_DEEPSPEED", "deepspeed"),
                           ("ACCELERATE_USE_FSDP", "fsdp")):
        if env.get(name, "").lower() in _TRUE and dist.strategy != strategy:
            problems.append(f"launched with {strategy} by the Accelerate config, but "
                            f"distributed.strategy is {dist.strategy}")
    accumulation = env.get("ACCELERATE_GRADIENT_ACCUMULATION_STEPS")
    ours = value(experiment, "gradient_accumulation_steps")
    if accumulation is not None and int(accumulation) != ours:
        problems.append(f"the Accelerate launch says gradient_accumulation_steps "
                        f"{accumulation}, but training.gradient_accumulation_steps is {ours}")
    ds_file = env.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if dist.strategy == "deepspeed" and ds_file and Path(ds_file).is_file():
        problems += deepspeed_file.problems(experiment, ds_file, precision)
    return problems


def process_group_problems(experiment: Experiment, args, device: str) -> list[str]:
    """After the training arguments set up torch.distributed: world size and backend."""
    import torch.distributed as dist

    expected = experiment.distributed.world_size
    problems = []
    if args.world_size != expected:
        problems.append(f"the trainer sees a world of {args.world_size} process(es), the "
                        f"experiment asks for {expected}")
    if expected > 1 and dist.is_available() and dist.is_initialized():
        backend = dist.get_backend()
        wanted = "gloo" if device == "cpu" else "nccl"
        if backend != wanted:
            problems.append(f"torch.distributed backend is {backend}, expected {wanted} on "
                            f"{device}")
    return problems
