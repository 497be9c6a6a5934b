"""Sequence and context parallelism (distributed.sequence_parallel, context_parallel):
the rules for what runs, checked by validate.

Sequence parallelism: finetune runs it as DeepSpeed ALST/Ulysses (accelerate's
ParallelismConfig sp_backend deepspeed, built in build.py): each row is cut along the
sequence over a group of processes, which exchange attention heads so that each computes
whole-sequence attention for its share of the heads. It trains on CPU (gloo) as well as on
GPUs, so it is tested here (tests/test_sequence_parallel.py); what is not listed stays
refused, with the library's reason or 'not verified'. Context parallelism (accelerate's
torch ring attention under FSDP2) runs only on GPUs: its rules are the libraries' own
requirements, and the Accelerate file that carries it is checked on CPU
(tests/test_context_parallel.py). Torch-free."""

from __future__ import annotations

from typing import Iterator

from finetune.config.derived.attention import HUB_KERNEL
from finetune.config.derived.effective import record
from finetune.config.methods import names_where, spoken
from finetune.config.rules.parallel import model_heads, not_a_multiple
from finetune.config.schema import Experiment

Problem = tuple[tuple, str]
LOC = ("distributed", "sequence_parallel")
# What accelerate 1.15's DeepSpeedSequenceParallelConfig accepts as sp_attn_implementation
# ("auto" resolves to one of them under sequence parallelism: effective.flattens).
ULYSSES_ATTENTION = ("auto", "sdpa", "flash_attention_2", "flash_attention_3")
VERIFIED_STAGES = (1, 2)


def check(exp: Experiment) -> Iterator[Problem]:
    yield from _sequence(exp)
    yield from _context(exp)


def _context(exp: Experiment) -> Iterator[Problem]:
    dist = exp.distributed
    cp = dist.context_parallel
    if cp == 1:
        return
    loc = ("distributed", "context_parallel")
    if dist.strategy != "fsdp" or dist.fsdp.version != 2:
        yield loc, ("needs strategy fsdp with fsdp.version 2: accelerate's torch context "
                    "parallelism shards the model with FSDP2 (ParallelismConfig cp_backend "
                    "torch)")
    if dist.sequence_parallel > 1 or dist.tensor_parallel > 1:
        yield loc, ("cannot be combined with sequence_parallel or tensor_parallel (accelerate: "
                    "\"Context Parallelism (CP) and Sequence Parallelism (SP) are mutually "
                    "exclusive\"; finetune's tensor parallelism is DeepSpeed's)")
    uneven = not_a_multiple(dist, "context_parallel")
    if uneven:
        yield loc, uneven
    if not record(exp).sequence_parallel:
        yield ("method",), (f"{exp.method} with context_parallel: offered for method sft only "
                            "(TRL's SFTTrainer handles context parallelism)")
    if exp.peft.type != "none":
        yield ("peft", "type"), (f"{exp.peft.type} with context_parallel is not verified; use "
                                 "peft.type none")
    if exp.model.attn_implementation != "sdpa":
        yield ("model", "attn_implementation"), (
            "must be sdpa with context_parallel (transformers: \"Context parallelism is "
            "supported only with SDPA attention\"; auto could pick another)")
    training = exp.training
    for name in ("packing", "padding_free"):
        if training.get(name):
            yield ("training", name), (
                "not supported with context_parallel: its attention is plain causal over the "
                "whole row (TRL: \"Packing is not compatible with context parallelism\")")
    multiple = training.get("pad_to_multiple_of")
    if multiple is not None and (not isinstance(multiple, int) or multiple % (2 * cp)):
        yield ("training", "pad_to_multiple_of"), (
            f"must be a multiple of {2 * cp} with context_parallel {cp}: torch's load "
            "balancer cuts each row into 2 x context_parallel chunks")


def _sequence(exp: Experiment) -> Iterator[Problem]:
    dist = exp.distributed
    sp = dist.sequence_parallel
    if sp == 1:
        return
    if dist.strategy != "deepspeed":
        yield LOC, ("needs strategy deepspeed (finetune runs sequence parallelism as DeepSpeed "
                    "ALST/Ulysses); accelerate's torch context parallelism (cp_size) needs "
                    "FSDP2, which accelerate 1.15 runs only on GPUs and finetune has not "
                    "verified")
    if dist.tensor_parallel > 1:
        yield LOC, ("with tensor_parallel does not run: tried on CPU (2 x 2 over 4 "
                    "processes), DeepSpeed stops with \"Check batch related parameters. "
                    "train_batch_size is not equal to micro_batch_per_gpu * "
                    "gradient_acc_step * world_size 4 != 4 * 1 * 2.0\" (under the Ulysses "
                    "groups it counts the tensor-parallel ranks as data parallel); use one "
                    "of them")
    uneven = not_a_multiple(dist, "sequence_parallel")
    if uneven:
        yield LOC, uneven
    stage = dist.deepspeed.zero_stage
    if dist.strategy == "deepspeed" and stage not in VERIFIED_STAGES:
        why = ("measured on CPU, it does not train as one process does (losses apart by 0.5 "
               "after 6 steps)") if stage == 3 else "not verified by finetune"
        yield ("distributed", "deepspeed", "zero_stage"), (
            f"{stage} with sequence_parallel: {why}; use zero_stage "
            f"{' or '.join(map(str, VERIFIED_STAGES))}")
    if exp.peft.type != "none":
        yield ("peft", "type"), (
            f"{exp.peft.type} with sequence_parallel: measured on CPU, LoRA under Ulysses "
            "does not train as one process does (losses apart by 0.07 after 6 steps); use "
            "peft.type none (full fine-tuning)")
    if not record(exp).sequence_parallel:
        verified = spoken(names_where(lambda m: m.sequence_parallel), "and")
        yield ("method",), (f"{exp.method} with sequence_parallel is not verified by finetune "
                            "(its trainer's own losses, generation or reference model); "
                            f"sequence_parallel runs method {verified}")
    yield from _rows(exp, sp)
    yield from _heads(exp, sp)


def _rows(exp: Experiment, sp: int) -> Iterator[Problem]:
    """What Ulysses needs of the batches and the attention."""
    attention = exp.model.attn_implementation
    if attention not in ULYSSES_ATTENTION and "flash-attn" not in attention:
        yield ("model", "attn_implementation"), (
            f"{attention} cannot run under sequence_parallel: Ulysses wraps sdpa or flash "
            "attention only (accelerate: \"'eager' and 'flex_attention' are not supported "
            "with sequence parallelism\"; finetune_varlen is not one it knows)")
    elif HUB_KERNEL.fullmatch(attention) and "flash-attn" not in attention:
        yield ("model", "attn_implementation"), (
            f"{attention} cannot run under sequence_parallel: accelerate takes only hub "
            "flash-attention kernels (e.g. kernels-community/flash-attn2)")
    training = exp.training
    for name in ("packing", "padding_free"):
        if training.get(name):
            yield ("training", name), (
                "not supported with sequence_parallel: Ulysses drops the attention mask and "
                "attends causally over the whole batch row, so flattened rows would attend "
                "to each other under sdpa (flash attention's position_ids route is not "
                "verified by finetune); rows are padded")
    if "max_length" in training and training["max_length"] is None:
        yield ("training", "max_length"), (
            "must be set with sequence_parallel: every batch is padded to it, since each "
            "rank's batch is gathered by the others, which needs equal shapes")
    if training.get("pad_to_multiple_of") is not None:
        yield ("training", "pad_to_multiple_of"), (
            "is finetune's with sequence_parallel (max_length rounded up to a multiple of "
            f"{sp}): leave it unset")
    if exp.data.weight_column is not None:
        yield ("data", "weight_column"), (
            "not supported with sequence_parallel: the Trainer's sequence-parallel loss is "
            "the model's own mean over tokens, so weights would be ignored")
    for name, refused in (("loss_type", "dft"), ("label_smoothing_factor", None)):
        value = training.get(name)
        if value is not None and (value == refused if refused else value):
            yield ("training", name), (
                f"{value} is refused by TRL with sequence_parallel: \"`loss_type='dft'`, "
                "`compute_loss_func` and `label_smoothing_factor` are not supported with "
                "DeepSpeed sequence parallelism (Ulysses/ALST)\"")


def _heads(exp: Experiment, sp: int) -> Iterator[Problem]:
    """Ulysses gives each rank an equal share of the query heads, and of the key-value
    heads unless there are fewer than ranks (then each rank takes a copy of one)."""
    for key, heads in model_heads(exp):
        if key == "num_attention_heads" and heads % sp:
            yield LOC, (f"{sp} does not divide the model's num_attention_heads ({heads}): "
                        "each process takes an equal share of the heads")
        if key == "num_key_value_heads" and heads % sp and sp % heads:
            yield LOC, (f"{sp} and the model's num_key_value_heads ({heads}) do not divide "
                        "one another (DeepSpeed Ulysses needs one to divide the other)")
