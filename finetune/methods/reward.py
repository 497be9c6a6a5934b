"""Reward modeling through TRL's RewardTrainer: a scalar head trained on chosen/rejected
pairs; its eval reports pairwise accuracy. With data.weight_column each pair's loss is
weighted (WeightedRewardTrainer)."""

from trl import RewardTrainer

from finetune.methods import Job


def build_trainer(job: Job) -> RewardTrainer:
    kwargs = dict(model=job.model, args=job.args, train_dataset=job.data.train,
                  eval_dataset=job.data.eval, processing_class=job.tokenizer,
                  callbacks=job.callbacks)
    if job.experiment.data.weight_column is None:
        return RewardTrainer(**kwargs)
    from finetune.trainers.weighted import WeightedRewardTrainer

    return WeightedRewardTrainer(**kwargs)
