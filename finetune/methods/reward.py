"""Reward modeling through TRL's RewardTrainer: a scalar head trained on chosen/rejected
pairs; its eval reports pairwise accuracy."""

from trl import RewardTrainer

from finetune.methods import Job


def build_trainer(job: Job) -> RewardTrainer:
    return RewardTrainer(model=job.model, args=job.args, train_dataset=job.data.train,
                         eval_dataset=job.data.eval, processing_class=job.tokenizer,
                         callbacks=job.callbacks)
