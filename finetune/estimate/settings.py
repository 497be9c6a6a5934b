"""What the estimate needs from an experiment, read once, with what had to be assumed.

Training keys come through trl_fields.training_value, so TRL's own defaults apply; a key
the method's config class does not have (max_length for classify and ppo) is not looked
up there but taken from the method's own section.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from finetune.config import attention, trl_fields
from finetune.config.schema import Experiment, PeftSection
from finetune.errors import ConfigError
from finetune.render.training_args import (attention_implementation, checkpointing_setting,
                                           training_kwargs)

# Methods whose trainer is TRL's: under (Q)LoRA on a quantized model it casts every
# trainable parameter except DoRA magnitudes to bf16 (trl sft_trainer.py and siblings).
TRL_TRAINERS = ("sft", "dpo", "reward", "grpo")
# grpo/ppo prompts have no length limit of their own in the experiment.
DEFAULT_PROMPT_TOKENS = 512


@dataclass(frozen=True)
class Layout:
    """How the model states are spread over the processes."""
    strategy: str                  # none, ddp, fsdp, deepspeed
    zero_stage: int = 0            # deepspeed only
    offload_optimizer: str = "none"
    offload_params: str = "none"
    fsdp_sharding: str = "FULL_SHARD"
    fsdp_offload: bool = False

    def label(self) -> str:
        if self.strategy == "deepspeed":
            text = f"deepspeed ZeRO-{self.zero_stage}"
            opt, par = self.offload_optimizer, self.offload_params
            if opt != "none" and par == opt:
                return f"{text}, offload optimizer+params ({opt})"
            if opt != "none":
                text += f", offload optimizer ({opt})"
            if par != "none":
                text += f", offload params ({par})"
            return text
        if self.strategy == "fsdp":
            return f"fsdp {self.fsdp_sharding}" + (", cpu offload" if self.fsdp_offload else "")
        return self.strategy


@dataclass(frozen=True)
class Settings:
    method: str
    precision: str                 # bf16, fp16, fp32
    device: str                    # cuda or cpu
    peft: PeftSection
    optim: str
    micro_batch: int
    seq_len: int
    logit_tokens: int              # positions per sequence whose logits get a loss
    sequences: int                 # sequences per sample (2 for chosen + rejected pairs)
    checkpointing: bool | None     # None: auto, decided against the device memory
    head: str                      # lm or score
    num_labels: int
    attention: str                 # sdpa, eager, flash
    mask: str                      # none, padding, flattened (tokens x tokens of the batch)
    fused_loss: bool               # use_liger_kernel: the logits are never materialised
    world: int
    per_machine: int
    layout: Layout
    trl_cast: bool                 # TRL casts trainable params of a quantized model to bf16
    reference: str                 # none, copy (of the policy, its dtype)
    value_model: str               # none, separate, shared (ppo)
    notes: tuple[str, ...] = field(default_factory=tuple)

    def with_(self, **changes: Any) -> "Settings":
        return replace(self, **changes)


def _value(exp: Experiment, key: str, effective: dict[str, Any] | None = None) -> Any:
    """The value the run's training arguments will have (finetune's effective settings,
    then TRL's default), or None where the method's config class lacks the key."""
    if effective is not None and key in effective:
        return effective[key]
    try:
        return trl_fields.training_value(exp.method, exp.training, key)
    except KeyError:
        return None


def _attention(exp: Experiment, device: str, precision: str, flattened: bool) -> tuple[str, str]:
    """(kernel family, mask) of the attention the run will use: a varlen/flash kernel keeps
    no mask; sdpa and eager keep a padding mask, or a dense mask over the whole flattened
    row for padding-free and packed batches."""
    implementation = attention_implementation(exp, device, precision)
    if attention.runs_varlen(implementation) or implementation == "flex_attention":
        return "flash", "none"
    kind = "eager" if implementation == "eager" else "sdpa"
    return kind, "flattened" if flattened else "padding"


def _sequence(exp: Experiment, seq_len: int | None, max_positions: int | None,
              notes: list[str]) -> tuple[int, int, int]:
    """(tokens per sequence, logit positions per sequence, sequences per sample)."""
    method = exp.method
    if method in ("grpo", "ppo"):
        completion = _value(exp, "max_completion_length") if method == "grpo" \
            else exp.ppo.max_new_tokens
        completion = completion or 512
        total = seq_len or DEFAULT_PROMPT_TOKENS + completion
        if seq_len is None:
            notes.append(f"{method}: sequences of {DEFAULT_PROMPT_TOKENS} prompt tokens (assumed; "
                         f"--seq-len sets the total) + {completion} completion tokens")
        return total, min(completion, total), 1
    if method == "classify":
        length = seq_len or exp.classify.max_length
        return length, 0, 1
    length = seq_len or _value(exp, "max_length")
    if length is None:
        if not max_positions:
            raise ConfigError(["training.max_length is null and the model config has no "
                               "max_position_embeddings: pass --seq-len"])
        length = max_positions
        notes.append(f"training.max_length is null: sequences of max_position_embeddings "
                     f"({length}) tokens")
    pairs = method in ("dpo", "reward")
    return length, (length if method in ("sft", "dpo") else 0), 2 if pairs else 1


def _layout(exp: Experiment, world: int) -> Layout:
    dist = exp.distributed
    strategy = dist.strategy
    if strategy == "none" and world > 1:
        strategy = "ddp"
    ds, fsdp = dist.deepspeed, dist.fsdp
    if strategy == "deepspeed":
        return Layout("deepspeed", ds.zero_stage, ds.offload_optimizer, ds.offload_params)
    if strategy == "fsdp":
        return Layout("fsdp", fsdp_sharding=fsdp.sharding_strategy, fsdp_offload=fsdp.cpu_offload)
    return Layout(strategy)


def settings_of(exp: Experiment, gpus: int | None = None, seq_len: int | None = None,
                max_positions: int | None = None, device: str | None = None,
                precision: str | None = None) -> Settings:
    """device and precision: as resolved on the machine (the worker); else assumed from
    the experiment (auto: CUDA, bf16)."""
    notes: list[str] = []
    dist = exp.distributed
    if device is None:
        device = "cpu" if dist.device == "cpu" else "cuda"
        if dist.device == "auto":
            notes.append("distributed.device auto: estimated for CUDA GPUs")
    if precision is None:
        precision = exp.precision
        if precision == "auto":
            precision = "fp32" if device == "cpu" else "bf16"
            if device == "cuda":
                notes.append("precision auto: bf16 (a GPU with bf16 support, Ampere or newer)")
    # The training arguments the worker will build, speed defaults included.
    effective = training_kwargs(exp, Path("run"), device, precision)
    value = lambda key: _value(exp, key, effective)
    world = gpus or dist.world_size
    per_machine = world // dist.num_machines if world % dist.num_machines == 0 else world
    if gpus and dist.strategy == "none" and gpus > 1:
        notes.append(f"--gpus {gpus} with strategy none: estimated as ddp")
    tokens, logits, sequences = _sequence(exp, seq_len, max_positions, notes)
    micro = value("per_device_train_batch_size") or 8
    head = "score" if exp.method in ("reward", "classify") else "lm"
    labels = len(exp.classify.labels) if exp.method == "classify" and exp.classify else 1
    flattened = bool(value("padding_free")) or bool(value("packing"))
    kind, mask = _attention(exp, device, precision, flattened)
    reference, value_model = "none", "none"
    if exp.method == "dpo" and (exp.peft.type == "none" or exp.dpo.ref_model):
        reference = "copy"
    if exp.method == "grpo" and exp.peft.type == "none" and (value("beta") or 0) > 0:
        reference = "copy"
    if exp.method == "ppo":
        reference = "copy" if exp.peft.type == "none" else "none"
        value_model = exp.ppo.value_model
    optim = value("optim") or "adamw_torch"
    setting = checkpointing_setting(exp)
    return Settings(
        method=exp.method, precision=precision, device=device, peft=exp.peft, optim=str(optim),
        micro_batch=int(micro), seq_len=int(tokens), logit_tokens=int(logits),
        sequences=sequences, checkpointing=None if setting == "auto" else setting, head=head,
        num_labels=labels, attention=kind, mask=mask,
        fused_loss=exp.method != "ppo" and bool(value("use_liger_kernel")),
        world=world, per_machine=max(per_machine, 1),
        layout=_layout(exp, world), trl_cast=exp.method in TRL_TRAINERS and precision != "fp32",
        reference=reference, value_model=value_model, notes=tuple(notes))
