"""Experiment -> Accelerate config file, in the form accelerate's own loader accepts.

On CPU, multi-process runs use distributed_type MULTI_GPU with use_cpu=True in the
training arguments: accelerate's own --cpu / MULTI_CPU without mpirun silently starts one
process (STACK_NOTES)."""

from __future__ import annotations

from typing import Any

from finetune.config.derived.effective import assumed_device, resolve_precision
from finetune.config.schema import Experiment

MIXED_PRECISION = {"fp32": "no", "bf16": "bf16", "fp16": "fp16"}


def static_precision(experiment: Experiment) -> str:
    """The precision a config file can state before the hardware is known: 'auto' as on a
    GPU with bf16 (the worker stops with a clear error if the GPU lacks bf16)."""
    return resolve_precision(experiment, assumed_device(experiment))


def _fsdp(experiment: Experiment) -> dict[str, Any]:
    """The keys accelerate 1.15 reads for each version (its launcher turns them into FSDP_*
    variables, from which Accelerator() builds the plugin the Trainer uses). The layer class
    to wrap is left to the model's _no_split_modules (the decoder layer)."""
    spec = experiment.distributed.fsdp
    config: dict[str, Any] = {
        "fsdp_version": spec.version,
        "fsdp_auto_wrap_policy": spec.auto_wrap_policy,
        "fsdp_offload_params": spec.cpu_offload,
        "fsdp_state_dict_type": spec.state_dict_type,
        "fsdp_cpu_ram_efficient_loading": True,
    }
    if spec.version == 2:
        # FSDP2 has no sync_module_states/use_orig_params (`accelerate to-fsdp2` drops
        # them); FULL_SHARD or SHARD_GRAD_OP only (config rules).
        config["fsdp_reshard_after_forward"] = spec.sharding_strategy == "FULL_SHARD"
    else:
        # FSDP1 takes sharding_strategy over reshard_after_forward, which its launcher
        # always sets; rank 0's weights are broadcast (cpu_ram_efficient_loading needs it).
        config.update(fsdp_sharding_strategy=spec.sharding_strategy,
                      fsdp_sync_module_states=True, fsdp_use_orig_params=True)
    return config


def accelerate_config(experiment: Experiment, deepspeed_file: str | None) -> dict[str, Any]:
    dist = experiment.distributed
    kind = {"none": "NO", "ddp": "MULTI_GPU", "fsdp": "FSDP", "deepspeed": "DEEPSPEED"}
    strategy = "ddp" if dist.strategy == "none" and dist.world_size > 1 else dist.strategy
    config: dict[str, Any] = {
        "compute_environment": "LOCAL_MACHINE",
        "distributed_type": kind[strategy],  # strategy none over N processes: DDP
        "mixed_precision": MIXED_PRECISION[static_precision(experiment)],
        "num_machines": dist.num_machines,
        "num_processes": dist.world_size,
        "machine_rank": 0,
        "main_process_ip": dist.main_process_ip,
        "main_process_port": dist.main_process_port,
        "rdzv_backend": dist.rdzv_backend,
        "same_network": True,
        "use_cpu": False,  # see the module docstring: never accelerate's --cpu
        "debug": False,
        "downcast_bf16": False,
    }
    if dist.strategy == "deepspeed":
        # Precision lives in the DeepSpeed file ("auto", filled from the experiment);
        # accelerate refuses a config file next to a mixed_precision of its own.
        del config["mixed_precision"]
        config["deepspeed_config"] = {
            "deepspeed_config_file": deepspeed_file,
            "zero3_init_flag": dist.deepspeed.zero_stage == 3,
            "deepspeed_multinode_launcher": "standard",
        }
    if dist.strategy == "fsdp":
        config["fsdp_config"] = _fsdp(experiment)
    if dist.context_parallel > 1:
        config["parallelism_config"] = _context_parallel(experiment)
    return config


def _context_parallel(experiment: Experiment) -> dict[str, Any]:
    """accelerate's torch context parallelism, as its launcher reads it from the file (it
    turns these keys into PARALLELISM_CONFIG_* variables, from which Accelerator() builds
    its ParallelismConfig; tests/test_context_parallel.py). FSDP2 shards over the
    processes that context parallelism leaves: dp_shard x cp = processes."""
    dist = experiment.distributed
    return {"parallelism_config_dp_replicate_size": 1,
            "parallelism_config_dp_shard_size": dist.world_size // dist.context_parallel,
            "parallelism_config_tp_size": 1,
            "parallelism_config_cp_size": dist.context_parallel,
            "parallelism_config_cp_backend": "torch",
            "parallelism_config_cp_comm_strategy": "allgather"}
