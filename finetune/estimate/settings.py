"""What the estimate needs from an experiment, read once, with what had to be assumed.

Training keys are read through config/derived/effective.py with the device and precision of the
run, so they are the values the worker's training arguments will have (speed defaults
included); what differs by method comes from the method's record (config/methods.py).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any

from finetune.config.derived import attention, effective
from finetune.config.derived.kernels import Kernels, installed
from finetune.config.methods import Method, method
from finetune.config.schema import Experiment, PeftSection
from finetune.errors import ConfigError
from finetune.estimate.vision.common import Training

# Generating methods' prompts have no length limit of their own in the experiment.
DEFAULT_PROMPT_TOKENS = 512
# A completion length setting of None (no limit): estimated at this many tokens.
DEFAULT_COMPLETION_TOKENS = 512


@dataclass(frozen=True)
class Layout:
    """How the model states are spread over the processes."""
    strategy: str                  # none, ddp, fsdp, deepspeed
    zero_stage: int = 0            # deepspeed only
    offload_optimizer: str = "none"
    offload_params: str = "none"
    fsdp_sharding: str = "FULL_SHARD"
    fsdp_offload: bool = False
    tensor_parallel: int = 1       # deepspeed AutoTP: processes splitting each linear
    sequence_parallel: int = 1     # deepspeed Ulysses: processes splitting each row

    def label(self) -> str:
        if self.strategy == "deepspeed":
            text = f"deepspeed ZeRO-{self.zero_stage}"
            if self.tensor_parallel > 1:
                text += f", tensor parallel {self.tensor_parallel}"
            if self.sequence_parallel > 1:
                text += f", sequence parallel {self.sequence_parallel}"
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
    # TRL's trainers cast every trainable parameter of a quantized model except DoRA
    # magnitudes to bf16 (trl sft_trainer.py and siblings).
    trl_cast: bool
    reference: str                 # none, copy (of the policy, in its load dtype)
    value_model: str               # none, separate, shared (ppo)
    notes: tuple[str, ...] = field(default_factory=tuple)
    images_per_row: int = 0        # a vision-language model's images in each row (assumed)
    vision_training: Training = Training()     # which vision parts train (all, by default)

    def with_(self, **changes: Any) -> "Settings":
        return replace(self, **changes)

    @property
    def record(self) -> Method:
        return method(self.method)


def _attention(exp: Experiment, device: str, precision: str, flattened: bool,
               kernels: Kernels) -> tuple[str, str]:
    """(kernel family, mask) of the attention the run will use: a varlen/flash kernel keeps
    no mask; sdpa and eager keep a padding mask, or a dense mask over the whole flattened
    row for padding-free and packed batches."""
    implementation = effective.attention_implementation(exp, device, precision, kernels)
    if attention.runs_varlen(implementation) or implementation == "flex_attention":
        return "flash", "none"
    kind = "eager" if implementation == "eager" else "sdpa"
    return kind, "flattened" if flattened else "padding"


def _sequence(exp: Experiment, own: Method, seq_len: int | None, max_positions: int | None,
              notes: list[str]) -> tuple[int, int, int]:
    """(tokens per sequence, logit positions per sequence, sequences per sample)."""
    if own.generates:
        completion = effective.setting(exp, own.completion_length) or DEFAULT_COMPLETION_TOKENS
        total = seq_len or DEFAULT_PROMPT_TOKENS + completion
        if seq_len is None:
            notes.append(f"{own.name}: sequences of {DEFAULT_PROMPT_TOKENS} prompt tokens "
                         "(assumed; --seq-len sets the total) + "
                         f"{completion} completion tokens")
        return total, min(completion, total), 1
    length = seq_len or effective.setting(exp, own.max_length)
    if length is None:
        if not max_positions:
            raise ConfigError([f"{own.max_length} is null and the model config has no "
                               "max_position_embeddings: pass --seq-len"])
        length = max_positions
        notes.append(f"{own.max_length} is null: sequences of max_position_embeddings "
                     f"({length}) tokens")
    return length, (length if own.logits == "sequence" else 0), own.sequences


def _reference(exp: Experiment, own: Method, value) -> str:
    """copy: the run holds a frozen reference besides the policy; none: it holds none
    (no reference, or the policy itself with its adapters disabled)."""
    spec = own.reference
    if spec is None:
        return "none"
    if spec.setting and effective.setting(exp, spec.setting):
        return "copy"  # another model, loaded even under (Q)LoRA
    if exp.peft.type != "none":
        return "none"
    if spec.switch and not (value(spec.switch) or 0) > 0:
        return "none"
    return "copy"


def _layout(exp: Experiment, world: int) -> Layout:
    dist = exp.distributed
    strategy = dist.strategy
    if strategy == "none" and world > 1:
        strategy = "ddp"
    ds, fsdp = dist.deepspeed, dist.fsdp
    if strategy == "deepspeed":
        return Layout("deepspeed", ds.zero_stage, ds.offload_optimizer, ds.offload_params,
                      tensor_parallel=dist.tensor_parallel,
                      sequence_parallel=dist.sequence_parallel)
    if strategy == "fsdp":
        return Layout("fsdp", fsdp_sharding=fsdp.sharding_strategy, fsdp_offload=fsdp.cpu_offload)
    return Layout(strategy)


def settings_of(exp: Experiment, gpus: int | None = None, seq_len: int | None = None,
                max_positions: int | None = None, device: str | None = None,
                precision: str | None = None, kernels: Kernels | None = None,
                model_type: str | None = None) -> Settings:
    """device and precision: as resolved on the machine (the worker); else assumed from
    the experiment (auto: CUDA, bf16). kernels: what the machine runs, as measured by the
    worker; else what is installed here. model_type: the model's, for what Liger patches."""
    notes: list[str] = []
    kernels = kernels or installed()
    dist = exp.distributed
    own = effective.record(exp)
    if device is None:
        device = effective.assumed_device(exp)
        if dist.device == "auto":
            notes.append("distributed.device auto: estimated for CUDA GPUs")
    if precision is None:
        precision = effective.resolve_precision(exp, device)
        if exp.precision == "auto" and device == "cuda":
            notes.append("precision auto: bf16 (a GPU with bf16 support, Ampere or newer)")
    # The training arguments the worker will build on this device, speed defaults included.
    value = lambda key: effective.value(exp, key, device, precision, default=None,
                                        kernels=kernels)
    world = gpus or dist.world_size
    per_machine = world // dist.num_machines if world % dist.num_machines == 0 else world
    if gpus and dist.strategy == "none" and gpus > 1:
        notes.append(f"--gpus {gpus} with strategy none: estimated as ddp")
    tp = dist.tensor_parallel
    if tp > 1:
        if world % tp:
            raise ConfigError([f"--gpus {world}: not a multiple of "
                               f"distributed.tensor_parallel {tp}"])
        notes.append(f"tensor_parallel {tp}: the decoder's linear layers split over {tp} "
                     "processes; activations are counted whole (an upper bound: AutoTP "
                     "splits the attention heads' and the MLP's)")
    tokens, logits, sequences = _sequence(exp, own, seq_len, max_positions, notes)
    sp = dist.sequence_parallel
    if sp > 1:
        if world % sp:
            raise ConfigError([f"--gpus {world}: not a multiple of "
                               f"distributed.sequence_parallel {sp}"])
        # Ulysses: each process holds 1/sp of every row between its all-to-alls, and the
        # heads' share of the whole row inside attention: the same elements either way.
        tokens, logits = -(-tokens // sp), -(-logits // sp)
        notes.append(f"sequence_parallel {sp}: each process holds {tokens} tokens of every "
                     f"row (1/{sp}); ZeRO shards over all {world} processes")
    micro = value("per_device_train_batch_size") or 8
    labels = effective.setting(exp, own.labels) if own.labels else None
    flattened = bool(value("padding_free")) or bool(value("packing"))
    kind, mask = _attention(exp, device, precision, flattened, kernels)
    fused = own.fused_loss and bool(value("use_liger_kernel"))
    if fused and kernels.liger is None:
        notes.append("use_liger_kernel: liger-kernel is not installed here; assumed "
                     f"installed where the run trains, patching {model_type}")
    elif fused and not kernels.liger_patches(model_type):
        # Liger patches the architectures it knows; others keep their logits and layers.
        notes.append(f"use_liger_kernel: liger-kernel patches no {model_type} model, so "
                     "the logits are counted")
        fused = False
    optim = value("optim") or "adamw_torch"
    setting = effective.checkpointing_setting(exp)
    return Settings(
        method=exp.method, precision=precision, device=device, peft=exp.peft, optim=str(optim),
        micro_batch=int(micro), seq_len=int(tokens), logit_tokens=int(logits),
        sequences=sequences, checkpointing=None if setting == "auto" else setting,
        head=own.head, num_labels=len(labels) if labels else 1, attention=kind, mask=mask,
        fused_loss=fused,
        world=world, per_machine=max(per_machine, 1),
        layout=_layout(exp, world), trl_cast=own.casts_quantized and precision != "fp32",
        reference=_reference(exp, own, value),
        value_model=effective.setting(exp, own.value_model) if own.value_model else "none",
        notes=tuple(notes))
