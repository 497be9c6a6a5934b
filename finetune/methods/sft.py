"""Supervised fine-tuning through TRL's SFTTrainer (messages, prompt/completion or text).

With per-sample weights (data.weight_column) or per-turn weights (`weight` on assistant
messages) the rows are tokenized by finetune.build.weighted_sft and trained by
WeightedSFTTrainer, whose loss is the weighted mean over the global batch. Only the
completion (prompt/completion rows) or the assistant turns (messages) are trained then."""

from trl import SFTTrainer

from finetune.build import weighted_sft
from finetune.errors import ConfigError
from finetune.methods import Job


def _weighted(job: Job) -> bool:
    return job.experiment.data.weight_column is not None or \
        weighted_sft.uses_token_weights(job.data.train, job.data.format)


def _weighted_trainer(job: Job):
    from finetune.trainers.weighted import WeightedSFTTrainer, pad_batch

    args, tokenizer = job.args, job.tokenizer
    packed = [name for name in ("packing", "padding_free") if getattr(args, name, False)]
    if packed:
        raise ConfigError([f"training.{packed[0]}: not supported with loss weights "
                           "(data.weight_column or `weight` on messages)"])
    with args.main_process_first(desc="tokenizing"):
        train = weighted_sft.tokenize(job.data.train, tokenizer, job.data.format,
                                      args.max_length, "train")
        evaluation = None if job.data.eval is None else weighted_sft.tokenize(
            job.data.eval, tokenizer, job.data.format, args.max_length, "eval")
    # Our rows are tokenized already; TRL must keep the weight column it does not know.
    args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    args.remove_unused_columns = False
    pad_id = tokenizer.pad_token_id
    return WeightedSFTTrainer(model=job.model, args=args, train_dataset=train,
                              eval_dataset=evaluation, processing_class=tokenizer,
                              data_collator=lambda rows: pad_batch(rows, pad_id),
                              callbacks=job.callbacks)


def build_trainer(job: Job) -> SFTTrainer:
    if _weighted(job):
        return _weighted_trainer(job)
    return SFTTrainer(model=job.model, args=job.args, train_dataset=job.data.train,
                      eval_dataset=job.data.eval, processing_class=job.tokenizer,
                      callbacks=job.callbacks)
