"""Supervised fine-tuning through TRL's SFTTrainer (messages, prompt/completion or text)."""

from trl import SFTTrainer

from finetune.methods import Job


def build_trainer(job: Job) -> SFTTrainer:
    return SFTTrainer(model=job.model, args=job.args, train_dataset=job.data.train,
                      eval_dataset=job.data.eval, processing_class=job.tokenizer,
                      callbacks=job.callbacks)
