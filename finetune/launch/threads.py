"""`finetune launch` on the CPU: the processes of one machine share its cores."""

from __future__ import annotations

from typing import Mapping

from finetune.config.schema import Experiment
from finetune.run.launched import cpu_cores


def launcher_threads(experiment: Experiment,
                     env: Mapping[str, str]) -> tuple[dict[str, str], str | None]:
    """`finetune launch` on the CPU: the launchers give each of N processes one thread when
    OMP_NUM_THREADS is unset (torchrun; accelerate's multi-process launch), so it is set
    for them to share the cores, unless the user did: the launcher's environment update,
    and a note that says so."""
    per_machine = experiment.distributed.per_machine
    if experiment.distributed.device != "cpu" or per_machine == 1 or env.get("OMP_NUM_THREADS"):
        return {}, None
    threads = max(1, cpu_cores() // per_machine)
    return {"OMP_NUM_THREADS": str(threads)}, (
        f"OMP_NUM_THREADS={threads} for each of the {per_machine} processes on this "
        f"machine's {cpu_cores()} cores (set OMP_NUM_THREADS yourself to choose)")
