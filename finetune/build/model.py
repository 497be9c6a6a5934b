"""The model: pretrained or freshly initialised, full, LoRA or QLoRA (bitsandbytes)."""

from __future__ import annotations

from pathlib import Path

import torch
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          BitsAndBytesConfig, PreTrainedModel, PreTrainedTokenizerBase)

from finetune.build.device import Hardware
from finetune.config.schema import Experiment
from finetune.errors import RunError

# Which head each method trains, and the PEFT task type that matches it.
HEADS = {
    "sft": (AutoModelForCausalLM, "CAUSAL_LM"),
    "dpo": (AutoModelForCausalLM, "CAUSAL_LM"),
    "reward": (AutoModelForSequenceClassification, "SEQ_CLS"),
}


def _quantization(experiment: Experiment, hw: Hardware) -> BitsAndBytesConfig | None:
    peft = experiment.peft
    if peft.type != "qlora":
        return None
    if peft.bits == 8:
        return BitsAndBytesConfig(load_in_8bit=True)
    return BitsAndBytesConfig(load_in_4bit=True, bnb_4bit_quant_type=peft.quant_type,
                              bnb_4bit_use_double_quant=peft.double_quant,
                              bnb_4bit_compute_dtype=hw.dtype)


def _load_dtype(experiment: Experiment, hw: Hardware) -> torch.dtype:
    # Full fine-tuning keeps fp32 master weights and lets autocast do the mixed precision;
    # under (Q)LoRA the frozen base can sit in the compute dtype and save half the memory.
    return torch.float32 if experiment.peft.type == "none" else hw.dtype


def load_model(experiment: Experiment, hw: Hardware, tokenizer: PreTrainedTokenizerBase,
               run_dir: Path) -> PreTrainedModel:
    auto_class, _ = HEADS[experiment.method]
    spec = experiment.model
    extra = {"num_labels": 1} if experiment.method == "reward" else {}
    try:
        config = AutoConfig.from_pretrained(spec.name_or_path, revision=spec.revision,
                                            trust_remote_code=spec.trust_remote_code, **extra)
    except OSError as exc:  # missing files, no network, unknown hub id
        raise RunError(f"cannot load the model config from {spec.name_or_path!r}: {exc}") from None
    config.pad_token_id = tokenizer.pad_token_id
    kwargs = {"trust_remote_code": spec.trust_remote_code}
    if spec.attn_implementation != "auto":
        kwargs["attn_implementation"] = spec.attn_implementation

    source, revision = spec.name_or_path, spec.revision
    if spec.init == "random":
        # Seeded by the caller. Saved once so that quantized loading and a later look at
        # the starting point both read the same weights.
        model = auto_class.from_config(config, dtype=torch.float32, **kwargs)
        source, revision = str(run_dir / "init-model"), None
        model.save_pretrained(source)
        if experiment.peft.type != "qlora":
            return model.to(_load_dtype(experiment, hw))
    quantization = _quantization(experiment, hw)
    if quantization is not None:
        kwargs["quantization_config"] = quantization
        kwargs["device_map"] = {"": 0} if hw.device == "cuda" else {"": "cpu"}
    return auto_class.from_pretrained(source, config=config, revision=revision,
                                      dtype=_load_dtype(experiment, hw), **kwargs)


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
