"""Tensor parallelism (distributed.tensor_parallel): the rules for what runs, checked by
validate. finetune runs it through DeepSpeed AutoTP, the one route of the stack that
trains on CPU (gloo) as well as on GPUs, so it is tested here; the combinations not
listed stay refused, each with the library's reason or 'not verified'. Torch-free.
Sequence parallelism: config/rules/sequence.py."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from finetune.config.derived.effective import record
from finetune.config.methods import names_where, spoken
from finetune.config.schema import Experiment

Problem = tuple[tuple, str]
LOC = ("distributed", "tensor_parallel")
# Why not the other route: transformers' tp_plan (from_pretrained(distributed_config=...))
# makes the Trainer build accelerate's ParallelismConfig, which accelerate 1.15 accepts
# only under FSDP2 or on GPUs (multi_device): with gloo on CPU it stops.
ACCELERATE_CPU = ("ParallelismConfig is only compatible DistributedType.FSDP (version 2) or "
                  "DistributedType.Multi{Device} or DistributedType.DEEPSPEED, but got "
                  "DistributedType.MULTI_CPU")
HEAD_KEYS = ("num_attention_heads", "num_key_value_heads")


def check(exp: Experiment) -> Iterator[Problem]:
    dist = exp.distributed
    tp = dist.tensor_parallel
    if tp == 1:
        return
    if dist.strategy != "deepspeed":
        yield LOC, ("needs strategy deepspeed (finetune runs tensor parallelism as DeepSpeed "
                    "AutoTP); transformers' tp_plan through accelerate's ParallelismConfig "
                    f"(ddp/fsdp) is not supported: on CPU accelerate 1.15 stops with "
                    f"'{ACCELERATE_CPU}', and on GPUs finetune has not verified it")
    uneven = not_a_multiple(dist, "tensor_parallel")
    if uneven:
        yield LOC, uneven
    elif dist.counted and dist.per_machine % tp:
        yield LOC, (f"{tp} does not divide the {dist.per_machine} processes of a machine: a "
                    "tensor-parallel group exchanges activations in every layer, so it stays "
                    "on one machine")
    if dist.deepspeed.zero_stage == 3:
        yield ("distributed", "deepspeed", "zero_stage"), (
            "3 with tensor_parallel is not verified by finetune (model creation under "
            "zero.Init before AutoTP shards it); use zero_stage 0, 1 or 2")
    if exp.peft.type != "none":
        yield ("peft", "type"), (f"{exp.peft.type} with tensor_parallel is not verified: "
                                 "AutoTP shards nn.Linear layers, PEFT wraps them; use "
                                 "peft.type none (full fine-tuning)")
    if not record(exp).tensor_parallel:
        verified = spoken(names_where(lambda m: m.tensor_parallel), "and")
        yield ("method",), (f"{exp.method} with tensor_parallel is not verified by finetune "
                            "(its trainer's own forward passes, generation or reference "
                            f"model); tensor_parallel runs method {verified}")
    for key, heads in model_heads(exp):
        if heads % tp:
            yield LOC, (f"{tp} does not divide the model's {key} ({heads}): each process "
                        "takes an equal share of the heads")


def not_a_multiple(dist, name: str) -> str | None:
    """The problem when the processes do not split into groups of distributed.<name>.
    Without a count the launcher's is taken, and checked then (run/launched.py)."""
    size = getattr(dist, name)
    if dist.counted and dist.world_size % size:
        return f"{dist.world_size} processes are not a multiple of {name} {size}"
    return None


def model_heads(exp: Experiment) -> Iterator[tuple[str, int]]:
    """A local model's attention and key-value head counts (nothing for a hub id, or an
    unreadable config: DeepSpeed reports them when it splits the model)."""
    try:
        config = json.loads((Path(exp.model.name_or_path) / "config.json").read_text())
    except (OSError, ValueError):
        return
    config = config.get("text_config", config) if isinstance(config, dict) else {}
    for key in HEAD_KEYS:
        heads = config.get(key) if isinstance(config, dict) else None
        if isinstance(heads, int) and heads > 0:
            yield key, heads
