"""Trainers for a vision-language model, resuming from their own checkpoints. A VLM's
save_pretrained writes the checkpoint's key names (LLaVA's `language_model.model.*`),
which transformers maps back only in from_pretrained; the Trainer's resume loads the
saved tensors by the module's names, finds none, warns and trains on from the weights it
started with. Here the weights come back through from_pretrained
(model/vision.load_saved_weights). A method TRL's trainer cannot train the model with
(Llama 3.2 Vision's grpo, rloo and distill: config/rules/vision.py) is refused before
it builds, as validate refuses it for a local model."""

from __future__ import annotations

from pathlib import Path

from trl import DPOTrainer, KTOTrainer, SFTTrainer

from finetune import compat
from finetune.config.rules.vision import method_refused
from finetune.data.rows import SPANS
from finetune.errors import ConfigError, DataError
from finetune.model.vision import load_saved_weights


class VisionCheckpoints:
    """Mixed in before every vision-language Trainer subclass (sft, dpo, kto, grpo, rloo,
    distill): its checkpoints' weights loaded back; a method the model cannot train with
    refused."""

    def __init__(self, *args, **kwargs):
        config = getattr(kwargs.get("model"), "config", None)
        refused = method_refused(getattr(config, "model_type", None), _method_of(self))
        if refused:
            raise ConfigError([f"method: {refused}"])
        super().__init__(*args, **kwargs)

    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        from peft import PeftModel

        target = self.model if model is None else model
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or isinstance(target, PeftModel):
            # sharded or adapter checkpoints: the Trainer's own loading (an adapter's keys
            # are PEFT's module names, which it maps itself: tests/test_vlm_lora.py)
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        load_saved_weights(target, Path(resume_from_checkpoint))


def _method_of(trainer) -> str:
    # imported already where they train
    from trl import DistillationTrainer, GRPOTrainer, RLOOTrainer

    for cls, name in ((SFTTrainer, "sft"), (DPOTrainer, "dpo"), (KTOTrainer, "kto"),
                      (GRPOTrainer, "grpo"), (RLOOTrainer, "rloo"),
                      (DistillationTrainer, "distill")):
        if isinstance(trainer, cls):
            return name
    raise TypeError(f"{type(trainer).__name__}: no method trains a vision-language model "
                    "with it")


class VisionSFTTrainer(VisionCheckpoints, SFTTrainer):
    def _set_signature_columns_if_needed(self):  # compat.OVERRIDES
        """TRL drops dataset columns its collator does not know; keep the assistant
        turns' spans (methods/vision_turns.py TurnsTrained reads them)."""
        super()._set_signature_columns_if_needed()
        columns = compat.signature_columns(self)
        if SPANS not in columns:
            compat.set_signature_columns(self, [*columns, SPANS])


class ImageTokensCut:
    """TRL's own error (DPOTrainer's, KTOTrainer's) for a training.max_length that cuts a
    prompt inside its image tokens, as one line saying which setting to raise (the rows
    that would be cut are dropped while preparing: methods/vision_lengths.py)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        try:
            return super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        except ValueError as exc:
            if "image placeholder" not in str(exc):
                raise
            raise DataError(f"training.max_length {self.args.max_length} cuts a row of this "
                            "batch inside its prompt's image tokens: raise it (`finetune data` "
                            "shows every row's length)") from None


class VisionDPOTrainer(VisionCheckpoints, ImageTokensCut, DPOTrainer):
    pass


class VisionKTOTrainer(VisionCheckpoints, ImageTokensCut, KTOTrainer):
    pass
