"""The settings a run will use, derived in one place: the keyword arguments of the method's
config class, the precision `auto` becomes, the attention kernel, and the dtype of every
model it loads. Torch-free.

The worker builds its training arguments from `arguments`; the rules, the fingerprint,
resume, the launch checks, the methods and `finetune estimate` read single values through
`value` (or `setting`, for any dotted experiment path). So the estimate models the run
that happens, and no module repeats a default of TRL's or of finetune's. Parts that
depend on the device (speed defaults, precision flags, the DeepSpeed config) are only
there when a device is given.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from finetune.config import stateful, trl_fields, vision
from finetune.config.derived import attention
from finetune.config.derived.deepspeed import deepspeed_dict
from finetune.config.derived.kernels import Kernels, installed
from finetune.config.methods import Method, method
from finetune.config.schema import Experiment

# Our defaults where TRL's do not suit a tool that writes its own run directory.
DEFAULTS: dict[str, Any] = {
    "report_to": "none",
    "logging_first_step": True,
    "save_strategy": "steps",
}
# training keys finetune's own upload reads (finetune/hub/upload.py), never the Trainer.
HUB_KEYS = ("hub_model_id", "hub_strategy", "hub_always_push", "hub_private_repo",
            "hub_revision")
_REQUIRED = object()  # value(): no default given, a key the class lacks is an error


def record(experiment: Experiment) -> Method:
    return method(experiment.method)


def assumed_device(experiment: Experiment) -> str:
    """The device as far as the experiment says: cpu, else cuda (`auto` is assumed to find
    a GPU: estimates and generated files are made before the hardware is seen)."""
    return "cpu" if experiment.distributed.device == "cpu" else "cuda"


def resolve_precision(experiment: Experiment, device: str, bf16_supported: bool = True) -> str:
    """The run's precision: as set, or what `auto` becomes on this device: fp32 on the
    CPU, bf16 on a GPU that supports it (Ampere or newer), else fp16. Whether a set
    precision can run there is hardware.py's question."""
    if experiment.precision != "auto":
        return experiment.precision
    if device == "cpu":
        return "fp32"
    return "bf16" if bf16_supported else "fp16"


def model_precision(role: str, peft_type: str, precision: str) -> str:
    """The precision each model of a run is loaded in, `precision` being the run's:
    - policy: fp32 under full fine-tuning (fp32 master weights; autocast computes in 16
      bits); under (Q)LoRA the frozen base sits in the compute precision, half the memory.
    - reference: the policy's, so that it equals the starting policy (grpo's, built by
      TRL from the policy's own dtype, is the same).
    - teacher (distill): a frozen model beside the policy, the reference's rule.
    - reward: the compute precision: it only scores, without gradients.
    - value: fp32: ppo's separate value model is trained in full, like the full policy.
    """
    if role in ("policy", "reference", "teacher"):
        return "fp32" if peft_type == "none" else precision
    if role == "reward":
        return precision
    if role == "value":
        return "fp32"
    raise ValueError(f"no model role {role!r}")


def flattens(experiment: Experiment) -> bool:
    """Would train flattened rows (padding-free or packed) on a varlen kernel. Weighted
    rows are padded, and so are models with remote code: transformers' own models mask
    across rows from the position_ids; remote code might not, and would silently attend
    across rows. Nor under sequence or context parallelism: both drop the attention mask,
    so rows are padded there (config/rules/sequence.py). Nor rows with images: TRL's vision
    collator pads them (a local vision-language model; a hub one is padded at training).
    Nor a model with a recurrent state (config/stateful.py; a hub one: at training)."""
    training = experiment.training
    return record(experiment).flattens and experiment.data.weight_column is None \
        and not experiment.model.trust_remote_code \
        and not vision.is_vision_language(experiment.model.name_or_path) \
        and stateful.stateful_type(experiment.model.name_or_path) is None \
        and experiment.distributed.sequence_parallel == 1 \
        and experiment.distributed.context_parallel == 1 \
        and (bool(training.get("packing")) or training.get("padding_free") is not False)


def attention_choice(experiment: Experiment, device: str, precision: str,
                     kernels: Kernels | None = None) -> tuple[str | None, str | None]:
    """(the attention the run's model is built with, why auto fell back or None). None:
    transformers' default, sdpa. kernels: what the machine runs, as measured by the
    worker; else what is installed here (config/derived/kernels.py)."""
    return attention.resolve(experiment.model.attn_implementation, device, precision,
                             flattens(experiment), kernels or installed())


def attention_implementation(experiment: Experiment, device: str, precision: str,
                             kernels: Kernels | None = None) -> str | None:
    return attention_choice(experiment, device, precision, kernels)[0]


def speed_defaults(experiment: Experiment, device: str, precision: str,
                   kernels: Kernels | None = None) -> dict[str, Any]:
    """Faster settings that change no result, each overridden by setting it in `training:`.
    (Fused AdamW is transformers' own default already: optim adamw_torch_fused.)"""
    training, out = experiment.training, {}
    kernels = kernels or installed()
    implementation = attention_implementation(experiment, device, precision, kernels)
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
        if record(experiment).liger_default and kernels.liger is not None:
            out["use_liger_kernel"] = True  # fused RMSNorm/RoPE/SwiGLU and chunked loss
    return {k: v for k, v in out.items() if k not in training}


def checkpointing_setting(experiment: Experiment) -> bool | str:
    """training.activation_checkpointing as set (or its deprecated alias
    gradient_checkpointing), else "auto": decided per run from the memory estimate
    (hardware.checkpointing_decision), since recomputing costs about a quarter of a step."""
    training = experiment.training
    setting = training.get("activation_checkpointing")
    if setting is None:
        setting = training.get("gradient_checkpointing")
    return "auto" if setting is None or setting == "auto" else bool(setting)


def arguments(experiment: Experiment, device: str | None = None, precision: str | None = None,
              run_dir: Path | None = None, checkpointing: bool | None = None,
              kernels: Kernels | None = None) -> dict[str, Any]:
    """The keyword arguments of the method's config class: finetune's defaults, the
    method's own, the speed defaults, the experiment's `training:`, then the fields
    finetune owns. device (and precision, else resolved for it) adds what depends on the
    device; run_dir the output directory. checkpointing: the decision for
    activation_checkpointing "auto" (None: TRL's default, on). kernels: what the device
    runs (attention_choice)."""
    speed = speed_defaults(experiment, device, precision or resolve_precision(
        experiment, device), kernels) if device else {}
    kwargs = {**DEFAULTS, **record(experiment).defaults, **speed,
              "run_name": experiment.name, **experiment.training}
    if checkpointing_setting(experiment) == "auto":
        kwargs.pop("activation_checkpointing", None)
        if checkpointing is not None:
            kwargs["activation_checkpointing"] = checkpointing
    # Checkpoint rotation is ours (callbacks.SealCheckpoints): the Trainer's would run
    # before a checkpoint is sealed and could delete the only complete one.
    kwargs.pop("save_total_limit", None)
    # Uploads are ours too (finetune/hub/upload.py: the final model with its card, once trained):
    # the Trainer's would push checkpoints/ to a repository named "checkpoints".
    kwargs["push_to_hub"] = False
    for key in HUB_KEYS:
        kwargs.pop(key, None)
    sequence_parallel = experiment.distributed.sequence_parallel
    if sequence_parallel > 1 and record(experiment).sequence_parallel:
        kwargs.setdefault("pad_to_multiple_of", sequence_length(experiment, kwargs))
    context_parallel = experiment.distributed.context_parallel
    if context_parallel > 1 and record(experiment).sequence_parallel:
        # torch's load balancer cuts each row into 2 x context_parallel chunks.
        kwargs.setdefault("pad_to_multiple_of", 2 * context_parallel)
    if run_dir is not None:
        kwargs["output_dir"] = str(run_dir / "checkpoints")
    if device:
        kwargs.update(_device_owned(experiment, device,
                                    precision or resolve_precision(experiment, device)))
    return kwargs


def sequence_length(experiment: Experiment, kwargs: dict[str, Any]) -> int | None:
    """The length every batch is padded to under sequence parallelism: max_length, rounded
    up to a multiple of sequence_parallel. Ulysses cuts each batch into equal slices of
    the sequence, and its data loader gathers every rank's batch from the others, which
    gloo accepts only when all are the same shape (rows padded to the longest in their
    own batch stop it). None without a max_length (refused by config/rules/parallel.py)."""
    length = kwargs.get("max_length", class_default(experiment.method, "max_length", None))
    if not isinstance(length, int):
        return None
    parts = experiment.distributed.sequence_parallel
    return -(-length // parts) * parts


def _device_owned(experiment: Experiment, device: str, precision: str) -> dict[str, Any]:
    """The fields finetune sets from precision and distributed."""
    owned: dict[str, Any] = {"bf16": precision == "bf16", "fp16": precision == "fp16",
                             "use_cpu": device == "cpu"}
    if device == "cpu" and experiment.distributed.world_size > 1:
        owned["ddp_backend"] = experiment.training.get("ddp_backend", "gloo")
    if experiment.distributed.strategy == "deepspeed":
        # A dict, rebuilt from the experiment: the bundle's deepspeed.json is its record.
        owned["deepspeed"] = deepspeed_dict(experiment)
    return owned


def value(experiment: Experiment, key: str, device: str | None = None,
          precision: str | None = None, default: Any = _REQUIRED,
          kernels: Kernels | None = None) -> Any:
    """A training argument as the run will have it: from `arguments`, else the config
    class's own default. A key the class lacks is a KeyError, or `default` if given."""
    assembled = arguments(experiment, device, precision, kernels=kernels)
    if key in assembled:
        return assembled[key]
    return class_default(experiment.method, key, default)


def class_default(method_name: str, key: str, default: Any = _REQUIRED) -> Any:
    """A training key's value when nothing sets it: finetune's default, the method's own,
    else its config class's (for a fingerprint, which keeps only the method's name)."""
    ours = {**DEFAULTS, **method(method_name).defaults}
    if key in ours:
        return ours[key]
    fields = trl_fields.fields_of(method_name)
    if key in fields:
        return fields[key].get("default")
    if default is _REQUIRED:
        raise KeyError(f"{key} is not a field of {'.'.join(method(method_name).config_class)}")
    return default


def setting(experiment: Experiment, path: str, device: str | None = None,
            precision: str | None = None) -> Any:
    """The setting at a dotted experiment path, as a record names it: training keys
    through `value`, other sections as the experiment holds them (None for a section
    it does not have)."""
    section, _, key = path.partition(".")
    if section == "training":
        return value(experiment, key, device, precision)
    node: Any = experiment
    for part in path.split("."):
        if node is None:
            return None
        node = getattr(node, part)
    return node
