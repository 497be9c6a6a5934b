"""LoRA and QLoRA adapters on top of the loaded model."""

from __future__ import annotations

import torch
from peft import LoraConfig, PeftModel, get_peft_model, prepare_model_for_kbit_training
from transformers import PreTrainedModel

from finetune.model.load import head
from finetune.config.schema import Experiment


def lora_config(experiment: Experiment) -> LoraConfig:
    spec = experiment.peft
    _, task_type = head(experiment)
    return LoraConfig(
        r=spec.r, lora_alpha=spec.alpha, lora_dropout=spec.dropout,
        target_modules=spec.target_modules, modules_to_save=spec.modules_to_save,
        bias=spec.bias, use_rslora=spec.use_rslora, use_dora=spec.use_dora,
        task_type=task_type,
    )


def apply_peft(model: PreTrainedModel, experiment: Experiment,
               gradient_checkpointing: bool) -> PreTrainedModel | PeftModel:
    if experiment.peft.type == "none":
        return model
    if experiment.peft.type == "qlora":
        model = prepare_model_for_kbit_training(
            model, use_gradient_checkpointing=gradient_checkpointing)
    return get_peft_model(model, lora_config(experiment))


def match_adapter_precision(model, precision: str) -> None:
    """TRL casts every trainable weight of a quantized model to bf16 (the QLoRA paper's
    choice), the reward head too, which then meets fp32 activations in an fp32 run. In an
    fp32 run the adapters are kept in fp32, as the precision setting says."""
    if precision != "fp32":
        return
    for param in model.parameters():
        if param.requires_grad and param.dtype != torch.float32:
            param.data = param.data.float()
