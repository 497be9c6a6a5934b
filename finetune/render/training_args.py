"""The one mapping from an Experiment to the keyword arguments of the method's TRL
config class. Everything the experiment owns (output directory, precision, device) is set
here and nowhere else; the rest of `training:` passes through unchanged. Torch-free."""

from __future__ import annotations

from importlib.util import find_spec
from pathlib import Path
from typing import Any

from finetune.config import attention
from finetune.config.schema import Experiment
from finetune.config.deepspeed import deepspeed_dict

# Our defaults where TRL's do not suit a tool that writes its own run directory.
DEFAULTS: dict[str, Any] = {
    "report_to": "none",
    "logging_first_step": True,
    "save_strategy": "steps",
}


def flattens(experiment: Experiment) -> bool:
    """sft that would train flattened rows (padding-free or packed) on a varlen kernel.
    Weighted sft pads, and so do models with remote code: transformers' own models mask
    across rows from the position_ids; remote code might not, and would silently attend
    across rows."""
    training = experiment.training
    return experiment.method == "sft" and experiment.data.weight_column is None \
        and not experiment.model.trust_remote_code \
        and (bool(training.get("packing")) or training.get("padding_free") is not False)


def attention_implementation(experiment: Experiment, device: str, precision: str) -> str | None:
    """The attention the run's model is built with (None: transformers' default, sdpa)."""
    return attention.resolve(experiment.model.attn_implementation, device, precision,
                             flattens(experiment))


def speed_defaults(experiment: Experiment, device: str, precision: str) -> dict[str, Any]:
    """Faster settings that change no result, each overridden by setting it in `training:`.
    (Fused AdamW is transformers' own default already: optim adamw_torch_fused.)"""
    training, out = experiment.training, {}
    implementation = attention_implementation(experiment, device, precision)
    if flattens(experiment) and not training.get("packing") and \
            attention.runs_varlen(implementation):
        # Flattened batches with position_ids: no compute spent on padding, and the same
        # loss as padded batches (each row attends only to itself; tests/test_speed.py,
        # tests/test_attention.py). Only with a varlen kernel: under sdpa the flattened
        # row gets a dense (tokens x tokens) mask and no flash kernel, 2.7x slower than
        # padding on an H100 (docs/benchmarks.md).
        out["padding_free"] = True
    if device == "cuda":
        out["dataloader_num_workers"] = 2  # collate while the GPU computes
        if experiment.method == "sft" and find_spec("liger_kernel") is not None:
            out["use_liger_kernel"] = True  # fused RMSNorm/RoPE/SwiGLU and chunked loss
    return {k: v for k, v in out.items() if k not in training}


def checkpointing_setting(experiment: Experiment) -> bool | str:
    """training.activation_checkpointing as set (or its deprecated alias
    gradient_checkpointing), else "auto": decided per run from the memory estimate
    (estimate.checkpointing_decision), since recomputing costs about a quarter of a step."""
    training = experiment.training
    value = training.get("activation_checkpointing")
    if value is None:
        value = training.get("gradient_checkpointing")
    return "auto" if value is None or value == "auto" else bool(value)


def training_kwargs(experiment: Experiment, run_dir: Path, device: str, precision: str,
                    checkpointing: bool | None = None) -> dict[str, Any]:
    """checkpointing: the decision for activation_checkpointing "auto" (None: TRL's default,
    on)."""
    kwargs = {**DEFAULTS, **speed_defaults(experiment, device, precision),
              "run_name": experiment.name, **experiment.training}
    if checkpointing_setting(experiment) == "auto":
        kwargs.pop("activation_checkpointing", None)
        if checkpointing is not None:
            kwargs["activation_checkpointing"] = checkpointing
    kwargs.update(
        output_dir=str(run_dir / "checkpoints"),
        bf16=precision == "bf16",
        fp16=precision == "fp16",
        use_cpu=device == "cpu",
    )
    # Checkpoint rotation is ours (callbacks.SealCheckpoints): the Trainer's would run
    # before a checkpoint is sealed and could delete the only complete one.
    kwargs.pop("save_total_limit", None)
    if device == "cpu" and experiment.distributed.world_size > 1:
        kwargs.setdefault("ddp_backend", "gloo")
    if experiment.distributed.strategy == "deepspeed":
        # A dict, rebuilt from the experiment: the bundle's deepspeed.json is its record.
        kwargs["deepspeed"] = deepspeed_dict(experiment)
    return kwargs
