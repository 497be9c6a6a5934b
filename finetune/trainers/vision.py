"""SFTTrainer for a vision-language model, resuming from its own checkpoints. A VLM's
save_pretrained writes the checkpoint's key names (LLaVA's `language_model.model.*`),
which transformers maps back only in from_pretrained; the Trainer's resume loads the
saved tensors by the module's names, finds none, warns and trains on from the weights it
started with. Here the weights come back through from_pretrained
(model/vision.load_saved_weights)."""

from __future__ import annotations

from pathlib import Path

from trl import SFTTrainer

from finetune.model.vision import load_saved_weights


class VisionSFTTrainer(SFTTrainer):
    def _load_from_checkpoint(self, resume_from_checkpoint: str, model=None) -> None:
        from peft import PeftModel

        target = self.model if model is None else model
        if self.is_deepspeed_enabled or self.is_fsdp_enabled or isinstance(target, PeftModel):
            # sharded or adapter checkpoints: the Trainer's own loading (an adapter's keys
            # are PEFT's module names, which it maps itself: tests/test_vlm_lora.py)
            super()._load_from_checkpoint(resume_from_checkpoint, model)
            return
        load_saved_weights(target, Path(resume_from_checkpoint))
