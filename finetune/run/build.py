"""What training (worker.py) and `finetune eval` (commands/eval_saved.py) build alike from an
experiment: the training arguments, the tokenizer and prepared data, the starting model
with its adapters, and the method's trainer. One path for both, so an evaluation sees
the model, data and trainer that training evaluated."""

from __future__ import annotations

import importlib
import os
import time
from pathlib import Path
from typing import Any

from finetune.config.derived import attention
from finetune.config.derived.effective import (arguments, attention_implementation, record,
                                       value)
from finetune.config.schema import Experiment
from finetune.config.secrets import REDACTED, is_secret
from finetune.data.prepare import prepared_data
from finetune.errors import ConfigError, RunError
from finetune.model.hardware import Hardware
from finetune.run.launched import launch_problems, process_group_problems
from finetune.methods import Job, build_trainer, preparation
from finetune.model.load import initial_weights, load_model, name_only_layers_it_has
from finetune.model.peft import apply_peft, match_adapter_precision, trainable_tensors
from finetune.model.tokenizer import load_processor, load_tokenizer
from finetune.model.vision import is_vision_language


def make_training_args(experiment: Experiment, run_dir: Path, hw: Hardware,
                       checkpointing: bool | None = None) -> Any:
    """The method's TRL config; creating it also sets up torch.distributed. Every rank
    first checks its launch environment, then the process group it joined."""
    problems = launch_problems(experiment, os.environ, hw.precision)
    if problems:
        raise RunError("; ".join(problems))
    if experiment.distributed.strategy == "deepspeed" and hw.device == "cpu":
        import deepspeed  # ZeRO-3 model creation needs the gloo group before the arguments

        deepspeed.init_distributed(dist_backend="gloo")
    module, name = record(experiment).config_class
    cls = getattr(importlib.import_module(module), name)
    kwargs = arguments(experiment, hw.device, hw.precision, run_dir, checkpointing, hw.kernels)
    _hand_secrets_to_hub(kwargs)
    if experiment.distributed.sequence_parallel > 1:
        kwargs["parallelism_config"] = sequence_parallelism(experiment, hw)
    try:
        args = cls(**kwargs)
    except (ValueError, TypeError) as exc:
        raise ConfigError([f"training: {module}.{name} rejected these settings: {exc}"]) from None
    problems = process_group_problems(experiment, args, hw.device)
    if problems:
        raise RunError("; ".join(problems))
    return args


def sequence_parallelism(experiment: Experiment, hw: Hardware) -> Any:
    """accelerate's ParallelismConfig for DeepSpeed ALST/Ulysses, handed to the Trainer
    through TrainingArguments.parallelism_config. Not through the Accelerate file: its
    parallelism_config keys reach the ranks as PARALLELISM_CONFIG_* variables that only
    `accelerate launch` sets, so a torchrun launch (distributed.launcher) or a SLURM
    script would silently train without it; the arguments are the same under every
    launcher. Every size is given, so no such variable changes it."""
    from accelerate import ParallelismConfig
    from accelerate.utils import DeepSpeedSequenceParallelConfig

    dist = experiment.distributed
    implementation = attention_implementation(experiment, hw.device, hw.precision, hw.kernels)
    # Ulysses wraps the attention the model runs, so it must be told which (config/rules/
    # refused the ones it cannot wrap); rows of varying length in every batch.
    handler = DeepSpeedSequenceParallelConfig(
        sp_seq_length_is_variable=True,
        sp_attn_implementation=attention.label(implementation))
    return ParallelismConfig(dp_replicate_size=dist.data_parallel, dp_shard_size=1, tp_size=1,
                             cp_size=1, cp_backend="torch", sp_size=dist.sequence_parallel,
                             sp_backend="deepspeed", sp_handler=handler)


def _hand_secrets_to_hub(kwargs: dict[str, Any]) -> None:
    """The Trainer pickles its arguments into every checkpoint and final/
    (training_args.bin), so no secret may be one of them. training.hub_token goes where
    huggingface_hub reads a token itself whenever it needs one (HF_TOKEN, this process
    and its children only; TrainingArguments' hub_token None means exactly that)."""
    for key in [k for k in kwargs if is_secret(k)]:
        value = kwargs.pop(key)
        if key == "hub_token" and value:
            os.environ["HF_TOKEN"] = str(value)


def without_redacted(experiment: Experiment) -> Experiment:
    """A resolved experiment read back has '<redacted>' where secrets were: those come
    from the environment (HF_TOKEN), never from a file."""
    training = {k: v for k, v in experiment.training.items() if v != REDACTED}
    return experiment.model_copy(update={"training": training})


def tokenizer_and_data(experiment: Experiment, run_dir: Path,
                       launched: float | None = None) -> tuple[Any, Any]:
    """The tokenizer and the prepared data (from the data cache next to run_dir).
    Before any process group exists: see data/prepare.py."""
    tokenizer = load_processor(experiment) if is_vision_language(experiment) \
        else load_tokenizer(experiment)  # a VLM's processor holds its tokenizer
    data = prepared_data(experiment, tokenizer, preparation(experiment), run_dir,
                         launched or time.time())
    return tokenizer, data


def starting_model(experiment: Experiment, hw: Hardware, tokenizer, init_dir: Path,
                   rank: int, args_dir: Path, checkpointing: bool | None) -> tuple[Any, Any]:
    """(training arguments, the model training starts from, adapters applied).
    model.init random: rank 0 saves the drawn weights to init_dir/init-model; they are
    loaded back from there where they must be (quantized, ZeRO-3)."""
    from transformers import set_seed

    initial = initial_weights(experiment, hw, tokenizer, init_dir, value(experiment, "seed"),
                              rank)
    args = make_training_args(experiment, args_dir, hw, checkpointing)
    args.distributed_state.wait_for_everyone()  # rank 0 has saved the initial weights
    set_seed(args.seed)
    model = load_model(experiment, hw, tokenizer, init_dir, initial)
    name_only_layers_it_has(model)
    initial = None  # loaded back from init-model/ (quantized, ZeRO-3): not kept alive
    # The adapters are drawn from the seed whatever loading drew: loaded under ZeRO-3
    # (zero.Init), CLIP's __init__ draws its class embedding with torch.randn; loaded on
    # the meta device, or kept in memory (DDP), a model draws nothing.
    set_seed(args.seed)
    return args, apply_peft(model, experiment, args.gradient_checkpointing)


def method_trainer(job: Job) -> Any:
    """The method's trainer for the job, as training runs it."""
    qlora = job.experiment.peft.type == "qlora"
    before = trainable_tensors(job.model) if qlora else {}  # TRL casts them to bf16
    trainer = build_trainer(job)
    if job.experiment.distributed.strategy == "fsdp" and not trainer.is_fsdp_enabled:
        raise RunError("distributed.strategy is fsdp, but the Trainer runs without FSDP: start "
                       "it with `finetune launch` (its accelerate.yaml turns FSDP on)")
    if qlora:
        match_adapter_precision(trainer.model, job.hardware.precision, before)
    return trainer
