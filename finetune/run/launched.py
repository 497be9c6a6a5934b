"""How this process was launched, checked against the experiment before training (some
launches exit 0 while running one process, or N independent copies; an Accelerate config
can silently change precision or turn on DeepSpeed), and its CPU threads. Torch-free at
import: `finetune train` runs the early checks before torch is loaded."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Mapping

from finetune.config.rules import deepspeed_file
from finetune.config.schema import Experiment
from finetune.config.derived.effective import resolve_precision, value
from finetune.render.accelerate import MIXED_PRECISION, static_precision

_TRUE = ("1", "true", "yes")


def rank_of(env: Mapping[str, str]) -> int:
    return int(env.get("RANK", "0"))


def record_failure(run_dir: Path, exc: Exception) -> None:
    """Leave the error where `finetune launch` looks for it (see errors.FAILED_MARKER)."""
    import json

    from finetune.errors import FAILED_MARKER, RunError
    from finetune.fileio.atomic import write_atomic

    problems = getattr(exc, "problems", None) or [str(exc)]
    rank = rank_of(os.environ)
    try:
        write_atomic(run_dir / FAILED_MARKER.replace(".json", f"-{rank}.json"),
                     json.dumps({"rank": rank, "errors": problems}))
    except RunError:
        pass  # a full or read-only disk: the error itself is still printed


def parallel_note(experiment: Experiment, device: str) -> str | None:
    """Said at the start of a run whose processes train as DDP although no strategy was
    asked for: `--num-processes N` (or num_processes) with strategy none."""
    dist = experiment.distributed
    if dist.strategy != "none" or dist.world_size == 1:
        return None
    return (f"{dist.world_size} processes with distributed.strategy none: data parallel "
            f"(DDP) on {device}")


def _launched_layout(env: Mapping[str, str]) -> tuple[int, int | None]:
    """Processes in all and machines, as the launcher (torchrun, or accelerate launch, which
    runs torchrun's) set them; machines None when it does not say (no LOCAL_WORLD_SIZE)."""
    world = int(env.get("WORLD_SIZE", "1"))
    if "WORLD_SIZE" not in env:
        return world, 1  # a plain `finetune train`: this one process
    local = int(env.get("LOCAL_WORLD_SIZE", "0"))
    return world, world // local if local and world % local == 0 else None


def _world_problem(world: int, experiment: Experiment) -> str:
    return (f"this process was started as one of {world} (WORLD_SIZE={world}), but the "
            f"experiment asks for {experiment.distributed.world_size} "
            "(distributed.num_processes / processes_per_machine x num_machines); start it with "
            "`finetune launch`, or leave the count out to take the launcher's")


def launcher_overrides(experiment: Experiment,
                       env: Mapping[str, str]) -> tuple[list[str], str | None]:
    """An experiment that gives no process count takes the launcher's (`accelerate launch
    -m finetune train EXP` need not say it twice): the overrides that say so, and a note.
    A count (or machine count) that truly disagrees is a RunError, before anything is
    prepared."""
    from finetune.errors import RunError

    dist = experiment.distributed
    world, machines = _launched_layout(env)
    if dist.counted:
        if world != dist.world_size:
            raise RunError(_world_problem(world, experiment))
        return [], None
    machines = machines or dist.num_machines
    if dist.num_machines not in (1, machines):  # given (not the default), and not so
        raise RunError(f"the launcher started {world} process(es) on {machines} machine(s) "
                       f"(WORLD_SIZE={world}, LOCAL_WORLD_SIZE={env.get('LOCAL_WORLD_SIZE')}), "
                       f"but the experiment asks for {dist.num_machines} machines "
                       "(distributed.num_machines)")
    if world == dist.world_size and machines == dist.num_machines:
        return [], None
    return ([f"distributed.num_processes={world}", f"distributed.num_machines={machines}"],
            f"distributed.num_processes {world} over {machines} machine(s), from the launcher "
            f"(WORLD_SIZE={world}); the experiment gives no process count")


def experiment_as_launched(config: str, overrides: list[str], env: Mapping[str, str]) -> Experiment:
    """What `finetune train` runs: the experiment, with the launcher's process count when it
    gives none (said once, by rank 0)."""
    from finetune.config import load_experiment

    experiment = load_experiment(config, overrides)
    extra, note = launcher_overrides(experiment, env)
    if not extra:
        return experiment
    if rank_of(env) == 0:
        print(f"finetune: {note}", flush=True)
    return load_experiment(config, [*overrides, *extra])


def early_launch_problems(experiment: Experiment, env: Mapping[str, str]) -> list[str]:
    """launch_problems before torch is imported, where the precision does not wait for the
    hardware (set in the experiment, or auto on the CPU): a launch that contradicts the
    experiment stops before any rank imports torch or writes the run directory. Every
    rank checks again once the hardware is known (build.py)."""
    device = experiment.distributed.device
    if experiment.precision == "auto" and device != "cpu":
        return []
    return launch_problems(experiment, env, resolve_precision(experiment, device))


def launch_problems(experiment: Experiment, env: Mapping[str, str], precision: str) -> list[str]:
    """What in the launch environment disagrees with the experiment (torch-free)."""
    dist = experiment.distributed
    problems = []
    world = int(env.get("WORLD_SIZE", "1"))
    if world != dist.world_size:
        problems.append(_world_problem(world, experiment))
    # With bf16 and fp16 off, TrainingArguments takes the launcher's mixed precision: an
    # Accelerate file saying bf16 would silently turn an fp32 experiment into bf16. A file
    # saying 'no' changes nothing (the experiment's bf16/fp16 flags win).
    launched = env.get("ACCELERATE_MIXED_PRECISION", "no")
    # precision auto: the generated file states what auto was assumed to become before the
    # GPU was seen (bf16); a GPU without bf16 makes it fp16, and the flags set that.
    expected = {MIXED_PRECISION[precision]}
    if experiment.precision == "auto":
        expected.add(MIXED_PRECISION[static_precision(experiment)])
    if launched != "no" and launched not in expected:
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
    return problems + _parallelism_problems(experiment, env)


def _parallelism_problems(experiment: Experiment, env: Mapping[str, str]) -> list[str]:
    """A hand-written Accelerate file's parallelism_config reaches the ranks as
    PARALLELISM_CONFIG_* variables; finetune hands the Trainer its own ParallelismConfig
    (build.py), which would silently win over a file that says otherwise."""
    dist = experiment.distributed
    if env.get("ACCELERATE_USE_PARALLELISM_CONFIG", "").lower() not in _TRUE:
        if dist.context_parallel > 1:
            return [f"distributed.context_parallel {dist.context_parallel} is carried by the "
                    "generated Accelerate file, and this launch did not read it: start it "
                    "with `finetune launch` (or `accelerate launch --config_file` the run's "
                    "accelerate.yaml)"]
        return []
    ours = {"SP": dist.sequence_parallel, "TP": 1, "CP": dist.context_parallel}
    problems = []
    for size, wanted in ours.items():
        said = env.get(f"PARALLELISM_CONFIG_{size}_SIZE", "1")
        if said != str(wanted):
            problems.append(
                f"the Accelerate launch says parallelism_config_{size.lower()}_size {said}, "
                f"but the experiment's is {wanted} (distributed.sequence_parallel, "
                "context_parallel; tensor parallelism is DeepSpeed's tensor_parallel): set "
                "it in the experiment")
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


# ---- CPU threads: N processes on one machine share its cores ----

def cpu_cores() -> int:
    """The cores this process may run on (a cgroup or taskset may allow fewer than exist)."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not on Linux
        return os.cpu_count() or 1


def cpu_threads(env: Mapping[str, str]) -> tuple[int | None, str]:
    """Threads for one training process on the CPU: the count to set (None: leave it to
    OMP_NUM_THREADS, or to torch's default for a process alone), and why."""
    cores, local = cpu_cores(), max(int(env.get("LOCAL_WORLD_SIZE", "1")), 1)
    given = env.get("OMP_NUM_THREADS")
    if given:
        spare = given.isdigit() and int(given) * local < cores
        return None, f"OMP_NUM_THREADS={given}" + (
            f"; {cores} cores for {local} process(es) here: OMP_NUM_THREADS="
            f"{cores // local} would use them all" if spare else "")
    if local == 1:
        return None, f"torch's default on {cores} cores; OMP_NUM_THREADS sets it"
    return max(1, cores // local), (f"{cores} cores / {local} processes on this machine; "
                                    "OMP_NUM_THREADS sets it")


def apply_cpu_threads(env: Mapping[str, str]) -> str:
    """Set this training process's CPU threads (cpu_threads); the start summary's line."""
    import torch

    threads, why = cpu_threads(env)
    if threads is not None:
        torch.set_num_threads(threads)
    return f"{torch.get_num_threads()} CPU thread(s) per process ({why})"
