"""LoRA and QLoRA adapters on top of the loaded model."""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import PreTrainedModel

from finetune.model import vision_parts
from finetune.model.frozen_tower import keep_frozen_tower_out_of_autograd
from finetune.model.load import head
from finetune.model.vision import is_vision_language
from finetune.config import fused_experts
from finetune.config.schema import Experiment
from finetune.errors import ConfigError


def lora_config(experiment: Experiment, model: PreTrainedModel) -> LoraConfig:
    spec = experiment.peft
    _, task_type = head(experiment)
    targets, to_save = spec.target_modules, spec.modules_to_save
    if is_vision_language(experiment):  # the language model's layers, not the tower's
        targets, to_save = vision_parts.lora_targets(model, experiment)
    return LoraConfig(
        r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
        target_modules=targets, modules_to_save=to_save,
        bias=spec.bias, use_rslora=spec.use_rslora, use_dora=spec.use_dora,
        task_type=task_type,
        # What AutoPeftModel loads the base at (model.name_or_path is written by PEFT).
        revision=experiment.model.revision if experiment.model.init == "pretrained" else None,
    )


def apply_peft(model: PreTrainedModel, experiment: Experiment,
               gradient_checkpointing: bool) -> PreTrainedModel | PeftModel:
    if experiment.vision is not None and not is_vision_language(experiment):
        raise ConfigError([f"vision: model.name_or_path {experiment.model.name_or_path} is "
                           "not a vision-language model: remove this section"])
    if experiment.peft.type == "none":
        if is_vision_language(experiment):
            vision_parts.freeze(model, experiment)  # vision.freeze_tower, train_projector
    else:
        if experiment.peft.type == "qlora":
            keep_4bit_layers_differentiable(model)
            model = prepare_model_for_kbit_training(
                model, use_gradient_checkpointing=gradient_checkpointing)
        config = lora_config(experiment, model)
        _refuse_dropout_on_fused_experts(config, model)
        model = get_peft_model(model, config)
    if is_vision_language(experiment):
        keep_frozen_tower_out_of_autograd(model)  # what trains is decided now
    return model


def _refuse_dropout_on_fused_experts(config: LoraConfig, model: PreTrainedModel) -> None:
    """config/fused_experts.py: peft puts LoRA on a mixture-of-experts model's fused
    expert parameters (and router) through its ParamWrapper, which takes no dropout, and
    would raise a traceback. Told here for any model from peft's own conversion of the
    config (validate tells it for a local model before anything loads)."""
    import copy

    from peft.utils.transformers_weight_conversion import (convert_peft_config_for_transformers,
                                                           get_model_conversion_mapping)

    if not config.lora_dropout:
        return
    probe = copy.deepcopy(config)  # peft converts the config in place as it applies it
    convert_peft_config_for_transformers(probe, model=model,
                                         conversions=get_model_conversion_mapping(model))
    wrapped = sorted(probe.target_parameters or ())
    if wrapped:
        reached = f"{', '.join(wrapped)}: peft.target_modules {config.target_modules!r} " \
                  "reaches them"
        why = fused_experts.refusal(model.config.model_type, config.lora_dropout, reached)
        raise ConfigError([f"peft.dropout: {why}"])


def trainable_tensors(model) -> dict[str, torch.Tensor]:
    """The trainable weights' tensors before the trainer is built, for
    match_adapter_precision to put back (references: nothing is copied)."""
    return {name: param.data for name, param in model.named_parameters() if param.requires_grad}


def keep_4bit_layers_differentiable(model) -> None:
    """bitsandbytes (0.50) repacks a 4-bit layer's weight for its CPU inference kernel at
    the layer's first forward in eval mode without autograd (an evaluation) on a CPU with
    AVX512-BF16, and keeps it so: every later forward runs that kernel, which has no
    backward, so after an evaluation (before training, or every eval_steps) no gradient
    went back through the quantized layers (to the LoRA of the layers below them, to a
    projector trained whole). A training run's layers keep the kernel they train with."""
    import bitsandbytes as bnb

    for module in model.modules():
        if isinstance(module, bnb.nn.Linear4bit):
            module.support_avx512bf16_for_cpu = False


def match_adapter_precision(model, precision: str, before: dict[str, torch.Tensor]) -> None:
    """TRL casts every trainable weight of a quantized model to bf16 (the QLoRA paper's
    choice), the reward head too, which then meets fp32 activations in an fp32 run. In an
    fp32 run the adapters are kept in fp32, as the precision setting says: the tensors they
    had before the trainer was built (`before`: trainable_tensors), not the bf16 ones cast
    back, which would start training from rounded weights (a projector or head trained
    whole, LoRA's A) and, where the method keeps a reference (dpo, kto, grpo, rloo), off
    it: TRL's frozen copy of the starting adapter, made before the cast, keeps them exact."""
    if precision != "fp32":
        return
    for name, param in model.named_parameters():
        if param.requires_grad and param.dtype != torch.float32:
            kept = before.get(name)
            fits = kept is not None and kept.dtype == torch.float32 and \
                kept.shape == param.shape
            param.data = kept if fits else param.data.float()


ADAPTER_CONFIG = "adapter_config.json"
# The files of a saved base model that make a directory loadable as one (no tokenizer:
# the adapter directory has its own).
BASE_FILES = ("config.json", "generation_config.json", "model.safetensors",
              "model.safetensors.index.json")


def embed_base(adapter_dir: Path, base_dir: Path) -> None:
    """Make an adapter of a random-init run loadable on its own. Its base exists only in
    the run (init-model/), so the base's files are placed next to the adapter (hard links:
    no extra disk; a copy where the file system has none). transformers loads such a
    directory as "a local model with an embedded adapter": AutoModelFor*.from_pretrained(
    adapter_dir) takes the base from there and applies the adapter, wherever the run
    directory is moved. PEFT's AutoPeftModel* loads base_model_name_or_path, which it
    resolves against the working directory, so that is the absolute init-model/ (it
    loads while the run stays where it was trained)."""
    names = [n for n in BASE_FILES if (base_dir / n).is_file()]
    names += sorted(p.name for p in base_dir.glob("model-*-of-*.safetensors"))
    for name in names:
        target = adapter_dir / name
        target.unlink(missing_ok=True)
        try:
            os.link(base_dir / name, target)
        except OSError:
            shutil.copy2(base_dir / name, target)
    config_path = adapter_dir / ADAPTER_CONFIG
    config = json.loads(config_path.read_text())
    config["base_model_name_or_path"] = str(base_dir.absolute())
    config["revision"] = None
    config_path.write_text(json.dumps(config, indent=2, sort_keys=True) + "\n")
