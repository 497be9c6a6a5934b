"""The model: pretrained or freshly initialised, full, LoRA or QLoRA (bitsandbytes)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase)

from finetune.model import vision
from finetune.model.hardware import Hardware
from finetune.config.derived import attention
from finetune.config.derived.effective import attention_implementation, record, setting
from finetune.config.derived.kernels import NOT_INSTALLED
from finetune.config.schema import Experiment
from finetune.errors import RunError, first_line

# Architectures whose attention passes sinks (s_aux), which finetune_varlen cannot run.
NO_VARLEN = ("gpt_oss",)

# A method's head (config/methods.py): the model class, and the PEFT task type that matches.
HEADS = {
    "lm": (AutoModelForCausalLM, "CAUSAL_LM"),
    "score": (AutoModelForSequenceClassification, "SEQ_CLS"),
}


def head(experiment: Experiment) -> tuple[type, str]:
    own = record(experiment).head
    if own == "lm" and vision.is_vision_language(experiment):  # its LM head on image+text
        return vision.MODEL_CLASS, HEADS[own][1]
    return HEADS[own]


def _quantization(experiment: Experiment, hw: Hardware) -> BitsAndBytesConfig | None:
    peft = experiment.peft
    if peft.type != "qlora":
        return None
    if peft.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=peft.quant_type,
                              bnb_4bit_use_double_quant=peft.double_quant,
                              bnb_4bit_compute_dtype=hw.dtype)


REMOTE_CODE_FILES = ("config.json", "tokenizer_config.json")


def _remote_code_message(source: str, key: str) -> str:
    return (f"{key} {source!r} ships its own modelling code (auto_map), and "
            "model.trust_remote_code is false: set model.trust_remote_code: true if you "
            "trust that code, or use a model transformers implements itself")


def remote_code_error(exc: ValueError, source: str, key: str) -> RunError:
    """transformers' ValueError for custom code it was told not to run (a hub model:
    nothing local to read first) as our one line; any other ValueError as it is."""
    if "trust_remote_code" not in str(exc):
        raise exc
    return RunError(_remote_code_message(source, key))


def refuse_remote_code(experiment: Experiment, source: str, key: str) -> None:
    """A local model or tokenizer with custom code (auto_map) while trust_remote_code is
    off: one line naming the setting, before transformers would raise (or prompt)."""
    if experiment.model.trust_remote_code or not Path(source).is_dir():
        return
    for name in REMOTE_CODE_FILES:
        try:
            content = json.loads((Path(source) / name).read_text())
        except (OSError, ValueError):
            continue  # absent or unreadable: transformers reports that itself
        if isinstance(content, dict) and content.get("auto_map"):
            raise RunError(_remote_code_message(source, key))


def context_length(experiment: Experiment) -> int | None:
    """The model's max_position_embeddings (of its text part), or None: the config has
    none, or cannot be read here (loading the model reports why)."""
    spec = experiment.model
    try:
        config = AutoConfig.from_pretrained(spec.name_or_path, revision=spec.revision,
                                            trust_remote_code=spec.trust_remote_code)
    except (OSError, ValueError):
        return None
    return getattr(config.get_text_config(), "max_position_embeddings", None)


def _config(experiment: Experiment, tokenizer: PreTrainedTokenizerBase):
    spec = experiment.model
    refuse_remote_code(experiment, spec.name_or_path, "model.name_or_path")
    extra = head_labels(experiment)
    try:
        config = AutoConfig.from_pretrained(spec.name_or_path, revision=spec.revision,
                                            trust_remote_code=spec.trust_remote_code, **extra)
    except OSError as exc:  # missing files, no network, unknown hub id
        raise RunError(f"model.name_or_path: cannot load the model config from "
                       f"{spec.name_or_path!r}: {first_line(exc)}") from None
    except ValueError as exc:
        raise remote_code_error(exc, spec.name_or_path, "model.name_or_path") from None
    pad = vision.text_tokenizer(tokenizer).pad_token_id  # a VLM's processor holds it
    config.pad_token_id = pad
    if config.get_text_config() is not config:
        config.get_text_config().pad_token_id = pad
    return config


def head_labels(experiment: Experiment) -> dict:
    """A score head's logits: one per class name of the method's labels setting (with
    id2label), else one; nothing for an LM head."""
    own = record(experiment)
    if own.head != "score":
        return {}
    if own.labels is None:
        return {"num_labels": 1}
    labels = setting(experiment, own.labels)
    return {"num_labels": len(labels), "id2label": dict(enumerate(labels)),
            "label2id": {name: i for i, name in enumerate(labels)}}


def attention_of(experiment: Experiment, hw: Hardware, config) -> str | None:
    """The attention implementation for this hardware (config/derived/effective.py decides
    auto); finetune's own varlen function is registered with transformers before it is
    named. `auto` does not pick it for a model whose attention it cannot run (logit
    softcapping, attention sinks): transformers' default then. flash-attention set by
    hand where it cannot run is one line naming why, not transformers' error at load."""
    implementation = attention_implementation(experiment, hw.device, hw.precision, hw.kernels)
    if implementation == "flash_attention_2" and hw.device == "cuda":
        unable = hw.kernels.flash_capable or (
            hw.kernels.flash_attn if hw.kernels.flash_attn != NOT_INSTALLED else None)
        if unable:
            raise RunError(f"model.attn_implementation flash_attention_2: {unable}; set it "
                           "to auto (or sdpa)")
    if implementation == "flash_attention_2" and experiment.model.attn_implementation == "auto" \
            and not vision.runs_flash_attention(config):
        return None  # transformers' default, sdpa (Llama 3.2 Vision: model/vision.py)
    if implementation != attention.VARLEN:
        return implementation
    unsupported = getattr(config, "attn_logit_softcapping", None) is not None or \
        config.model_type in NO_VARLEN
    if unsupported and experiment.model.attn_implementation == "auto":
        return None
    from finetune.model import varlen

    varlen.register()
    return implementation


def _kwargs(experiment: Experiment, hw: Hardware, config) -> dict:
    kwargs = {"trust_remote_code": experiment.model.trust_remote_code}
    implementation = attention_of(experiment, hw, config)
    if implementation is not None:
        kwargs["attn_implementation"] = implementation
    return kwargs


def initial_weights(experiment: Experiment, hw: Hardware, tokenizer: PreTrainedTokenizerBase,
                    run_dir: Path, seed: int, rank: int) -> PreTrainedModel | None:
    """model.init random: build the weights from the seed, before the training arguments
    exist. Under ZeRO-3 those arguments make every model creation a partitioned zero.Init,
    which would draw other numbers; built first, every layout starts from the same weights.
    Rank 0 saves them to init-model/ for loading back (quantized, partitioned, sharded).
    Under FSDP only rank 0 draws them, on the CPU, and keeps none: every rank loads them
    back as FSDP shards them (rank 0 reads, the others start empty: cpu_ram_efficient_
    loading), where a whole fp32 model on every GPU would not fit for large models."""
    if experiment.model.init != "random":
        return None
    sharded = experiment.distributed.strategy == "fsdp"
    if sharded and rank != 0:
        return None
    from transformers import set_seed

    set_seed(seed)
    auto_class, _ = head(experiment)
    # Drawn where the model will train: on a GPU, seconds of CPU random numbers (~8 s for
    # 0.5B) become milliseconds. The seeded CUDA generator makes it as reproducible.
    config = _config(experiment, tokenizer)
    with torch.device("cpu" if sharded else hw.torch_device):
        model = auto_class.from_config(config, dtype=torch.float32,
                                       **_kwargs(experiment, hw, config))
    if rank == 0:
        target = run_dir / "init-model"
        staging = run_dir / ".init-model.tmp"
        shutil.rmtree(staging, ignore_errors=True)
        model.save_pretrained(staging)
        shutil.rmtree(target, ignore_errors=True)
        staging.rename(target)
    return None if sharded else model


def load_model(experiment: Experiment, hw: Hardware, tokenizer: PreTrainedTokenizerBase,
               run_dir: Path, initial: PreTrainedModel | None) -> PreTrainedModel:
    """The model to train. `initial` is the random-init model, used as is unless it must
    be loaded back from init-model/ (quantized, ZeRO-3-partitioned, or FSDP, where no
    rank keeps one; the caller has waited for rank 0 to save it)."""
    from transformers.integrations import is_deepspeed_zero3_enabled

    quantization = _quantization(experiment, hw)
    if initial is not None and quantization is None and not is_deepspeed_zero3_enabled():
        return initial.to(hw.model_dtype(experiment, "policy"))
    source, revision = experiment.model.name_or_path, experiment.model.revision
    if experiment.model.init == "random":
        source, revision = str(run_dir / "init-model"), None
    config = _config(experiment, tokenizer)
    kwargs = _kwargs(experiment, hw, config)
    if quantization is not None:
        if vision.is_vision_language(experiment):  # the tower and projector stay whole
            from finetune.model.vision_parts import unquantized

            quantization.llm_int8_skip_modules = unquantized(experiment, config)
        kwargs["quantization_config"] = quantization
        kwargs["device_map"] = quantized_placement(hw)
    return head(experiment)[0].from_pretrained(
        source, config=config, revision=revision,
        dtype=hw.model_dtype(experiment, "policy"), **kwargs)


def name_only_layers_it_has(model: PreTrainedModel) -> None:
    """The model's _no_split_modules (the layers FSDP makes units of, and device_map keeps
    whole) cut to the classes it has. transformers gathers them from every class a model
    is built from: a LLaVA names CLIPTextEmbeddings (CLIP's text half, which it lacks), a
    Gemma 3 or a PaliGemma SigLIP's text embeddings and pooling head; accelerate's
    transformer-based wrap, and peft's under LoRA, stop on a name the model has no module
    of ("Could not find the transformer layer class")."""
    names = getattr(model, "_no_split_modules", None)
    if names:
        present = {type(module).__name__ for module in model.modules()}
        model._no_split_modules = {name for name in names if name in present}


def quantized_placement(hw: Hardware) -> dict:
    """Where bitsandbytes puts a quantized model: this process's own GPU (one process per
    GPU, hardware.local_gpu), whole."""
    return {"": hw.index if hw.device == "cuda" else "cpu"}


def count_parameters(model: torch.nn.Module) -> tuple[int, int]:
    """(trainable, total); 4-bit weights count by their logical size."""
    trainable = total = 0
    for param in model.parameters():
        n = param.numel()
        if hasattr(param, "quant_state") or param.__class__.__name__ == "Params4bit":
            n *= 2  # two 4-bit values per stored byte
        total += n
        if param.requires_grad:
            trainable += n
    return trainable, total


def tied_parameters(model: torch.nn.Module) -> set[str]:
    """The names of parameters that share another parameter's tensor (an output layer
    tied to the input embeddings): a checkpoint stores each shared tensor once."""
    names: dict[int, list[str]] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(param), []).append(name)
    return {name for group in names.values() if len(group) > 1 for name in group}


def load_full_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load a whole model saved with save_pretrained (model.safetensors, or its shards)
    into `model`, in place. A ValueError when the weights do not fit it; a
    FileNotFoundError when there are none."""
    if vision.is_vision_model(model):
        vision.load_saved_weights(model, directory)
        return
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        from transformers.modeling_utils import load_sharded_checkpoint

        load_sharded_checkpoint(model, str(directory), strict=False)
        return
    from safetensors.torch import load_file

    state = load_file(str(directory / "model.safetensors"))
    result = model.load_state_dict(state, strict=False)
    tied = set(getattr(model, "all_tied_weights_keys", None) or ())
    missing = [k for k in result.missing_keys if k not in tied and not k.endswith("lm_head.weight")]
    if missing or result.unexpected_keys:
        raise ValueError(f"{directory}: weights do not match the model (missing "
                         f"{missing[:5]}, unexpected {result.unexpected_keys[:5]})")


def load_weights(model: torch.nn.Module, directory: Path) -> None:
    """Load what the Trainer saved of `model` (final/, a checkpoint) into it, in place: the
    adapter of a peft model (adapter_model.safetensors), else the whole model."""
    from peft import PeftModel

    if not isinstance(model, PeftModel):
        load_full_weights(model, directory)
        return
    from peft import set_peft_model_state_dict
    from safetensors.torch import load_file

    state = load_file(str(directory / "adapter_model.safetensors"))
    result = set_peft_model_state_dict(model, state)
    if getattr(result, "unexpected_keys", None):
        raise ValueError(f"{directory}: adapter weights do not match "
                         f"({result.unexpected_keys[:5]})")
