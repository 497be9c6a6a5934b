"""Sequence classification (`method: classify`): text -> one of classify.labels, with
class weights (given or balanced), focal loss, label smoothing and per-sample weights.
Eval reports accuracy, macro-F1 and each class's recall."""

from __future__ import annotations

from transformers import DataCollatorWithPadding

from finetune.data.load import WEIGHT, Splits
from finetune.data.parallel import processes
from finetune.config.schema import Experiment
from finetune.methods import Job
from finetune.trainers.classify import ClassifyTrainer, balanced_weights, classification_metrics


def _tokenized(dataset, tokenizer, max_length: int, num_proc: int | None = None):
    def one(row):
        encoded = tokenizer(row["text"], truncation=True, max_length=max_length)
        out = {"input_ids": encoded["input_ids"], "labels": row["label"]}
        if WEIGHT in row:
            out[WEIGHT] = float(row[WEIGHT])
        return out

    return dataset.map(one, remove_columns=dataset.column_names, num_proc=num_proc,
                       desc="tokenizing")


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    """Tokenized rows (run once by data/prepare.py, cached)."""
    return splits.tokenized(
        lambda rows, _: _tokenized(rows, tokenizer, experiment.classify.max_length,
                                   processes(experiment, len(rows))))


def build_trainer(job: Job) -> ClassifyTrainer:
    spec = job.experiment.classify
    weights = spec.class_weights
    if weights == "balanced":
        weights = balanced_weights(job.data.train["labels"], spec.labels)
    elif weights is None:
        weights = [1.0] * len(spec.labels)
    return ClassifyTrainer(
        model=job.model, args=job.args, train_dataset=job.data.train,
        eval_dataset=job.data.eval,
        processing_class=job.tokenizer, data_collator=DataCollatorWithPadding(job.tokenizer),
        compute_metrics=classification_metrics(spec.labels), callbacks=job.callbacks,
        class_weights=weights, focal_gamma=spec.focal_gamma,
        label_smoothing=spec.label_smoothing)
