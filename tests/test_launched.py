"""run/launched.py's and launch/threads.py's torch-free decisions, on the environments
launchers set: the process count an experiment takes from its launcher, and CPU threads
per process.
(tests/test_launch.py launches for real.)"""

from __future__ import annotations

import os

import pytest

from conftest import MINIMAL_SFT
from finetune.config import load_experiment
from finetune.errors import RunError
from finetune.launch.threads import launcher_threads
from finetune.run.launched import (cpu_cores, cpu_threads, experiment_as_launched,
                                   launcher_overrides)


def exp(write, distributed: str = "{device: cpu}"):
    return load_experiment(write("exp.yaml", MINIMAL_SFT + f"distributed: {distributed}\n"))


def torchrun(world: int, local: int) -> dict[str, str]:
    return {"WORLD_SIZE": str(world), "LOCAL_WORLD_SIZE": str(local), "RANK": "0"}


def test_no_count_takes_the_launchers(write):
    assert launcher_overrides(exp(write), {}) == ([], None)  # `finetune train` alone
    assert launcher_overrides(exp(write), torchrun(1, 1)) == ([], None)
    extra, note = launcher_overrides(exp(write), torchrun(8, 4))
    assert extra == ["distributed.num_processes=8", "distributed.num_machines=2"]
    assert note == ("distributed.num_processes 8 over 2 machine(s), from the launcher "
                    "(WORLD_SIZE=8); the experiment gives no process count")
    # a launcher that does not say how many per machine: the experiment's machines
    assert launcher_overrides(exp(write), {"WORLD_SIZE": "2"})[0] == [
        "distributed.num_processes=2", "distributed.num_machines=1"]
    # machines given and matching
    assert launcher_overrides(exp(write, "{strategy: ddp, num_machines: 2}"), torchrun(8, 4))[0] \
        == ["distributed.num_processes=8", "distributed.num_machines=2"]


def test_a_count_that_disagrees_is_refused(write):
    with pytest.raises(RunError, match="started as one of 4 \\(WORLD_SIZE=4\\), but the "
                                       "experiment asks for 2"):
        launcher_overrides(exp(write, "{strategy: ddp, num_processes: 2}"), torchrun(4, 4))
    with pytest.raises(RunError, match="asks for 4"):
        launcher_overrides(exp(write, "{strategy: ddp, processes_per_machine: 2, "
                                      "num_machines: 2}"), torchrun(2, 2))
    with pytest.raises(RunError, match="the launcher started 4 process\\(es\\) on 1 machine"):
        launcher_overrides(exp(write, "{strategy: ddp, num_machines: 2}"), torchrun(4, 4))
    with pytest.raises(RunError, match="started as one of 1"):  # `finetune train` alone
        launcher_overrides(exp(write, "{strategy: ddp, num_processes: 2}"), {})
    given = exp(write, "{strategy: ddp, num_processes: 4}")
    assert launcher_overrides(given, torchrun(4, 2)) == ([], None)


def test_the_taken_count_is_validated_and_said_by_rank_0(write, capsys):
    path = write("exp.yaml", MINIMAL_SFT + "distributed: {device: cpu}\n")
    launched = experiment_as_launched(str(path), [], torchrun(2, 2))
    assert launched.distributed.num_processes == 2 and launched.distributed.num_machines == 1
    assert "from the launcher (WORLD_SIZE=2)" in capsys.readouterr().out
    experiment_as_launched(str(path), [], {**torchrun(2, 2), "RANK": "1"})
    assert capsys.readouterr().out == ""


def test_cpu_threads_share_the_cores_unless_omp_num_threads_is_set():
    cores = cpu_cores()
    assert cores == len(os.sched_getaffinity(0))
    assert cpu_threads({"LOCAL_WORLD_SIZE": "2"}) == (
        max(1, cores // 2), f"{cores} cores / 2 processes on this machine; OMP_NUM_THREADS sets it")
    assert cpu_threads({"LOCAL_WORLD_SIZE": str(cores * 4)})[0] == 1  # never 0
    assert cpu_threads({}) == (None, f"torch's default on {cores} cores; OMP_NUM_THREADS sets it")
    assert cpu_threads({"OMP_NUM_THREADS": str(cores), "LOCAL_WORLD_SIZE": "1"}) == (
        None, f"OMP_NUM_THREADS={cores}")
    # a launcher's 1 on a machine with cores to spare: the note says what would use them
    threads, why = cpu_threads({"OMP_NUM_THREADS": "1", "LOCAL_WORLD_SIZE": "1"})
    assert threads is None and (why == "OMP_NUM_THREADS=1" if cores == 1 else why == (
        f"OMP_NUM_THREADS=1; {cores} cores for 1 process(es) here: OMP_NUM_THREADS={cores} "
        "would use them all"))


def test_finetune_launch_sets_threads_for_the_launcher_unless_given(write):
    two = exp(write, "{device: cpu, num_processes: 2}")
    update, note = launcher_threads(two, {})
    threads = max(1, cpu_cores() // 2)
    assert update == {"OMP_NUM_THREADS": str(threads)}
    assert note.startswith(f"OMP_NUM_THREADS={threads} for each of the 2 processes")
    assert launcher_threads(two, {"OMP_NUM_THREADS": "3"}) == ({}, None)
    assert launcher_threads(exp(write), {}) == ({}, None)  # one process: torch's own default
    assert launcher_threads(exp(write, "{device: cuda, num_processes: 2}"), {}) == ({}, None)


def test_precision_auto_on_a_gpu_without_bf16_is_no_launch_error(write):
    """The generated Accelerate file states what precision auto becomes before the GPU is
    seen (bf16); on a GPU without native bf16 the worker resolves fp16 and its flags win."""
    from finetune.run.launched import launch_problems

    launched = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    auto = exp(write, "{device: cuda}")
    assert launch_problems(auto, launched, "fp16") == []
    assert launch_problems(auto, {"ACCELERATE_MIXED_PRECISION": "fp16"}, "bf16") == [
        "the Accelerate launch says mixed_precision 'fp16', but the experiment's precision is "
        "bf16; set it in one place: precision"]
    fp16 = load_experiment(write("fp16.yaml", MINIMAL_SFT + "precision: fp16\n"
                                 "distributed: {device: cuda}\n"))
    assert launch_problems(fp16, launched, "fp16")  # set by hand: the file contradicts it


def test_early_checks_run_only_where_the_precision_is_known_without_the_hardware(write):
    """Before torch is imported: a precision set by hand, or auto on the CPU (fp32), is
    checked against the launcher's; auto on a GPU waits for the hardware (build.py)."""
    from finetune.run.launched import early_launch_problems

    bf16 = {"ACCELERATE_MIXED_PRECISION": "bf16"}
    assert early_launch_problems(exp(write, "{device: cpu}"), bf16) == [
        "the Accelerate launch says mixed_precision 'bf16', but the experiment's precision is "
        "fp32; set it in one place: precision"]
    assert early_launch_problems(exp(write, "{device: cuda}"), bf16) == []
    assert early_launch_problems(exp(write, "{device: auto}"), bf16) == []
    fp16 = load_experiment(write("fp16.yaml", MINIMAL_SFT + "precision: fp16\n"
                                 "distributed: {device: auto}\n"))
    assert early_launch_problems(fp16, bf16)  # set by hand: known before the hardware
    assert early_launch_problems(exp(write, "{device: cpu}"), {}) == []
