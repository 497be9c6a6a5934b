"""Reward modeling through TRL's RewardTrainer: a scalar head trained on chosen/rejected
pairs; its eval reports pairwise accuracy. With data.weight_column each pair's loss is
weighted (WeightedRewardTrainer).

The pairs are tokenized here, as RewardTrainer would (prompt + answer, an EOS after plain
text; the chat template for messages) except for encoders, whose tokenizer frames each
text itself ([CLS] ... [SEP]) and gets no EOS (model/tokenizer.py end_marker), once per machine and cached (data/prepare.py):
RewardTrainer recognises tokenized rows and only filters them by max_length."""

from __future__ import annotations

from typing import Any

from trl import RewardTrainer

from finetune.data.load import ORIGIN, Splits
from finetune.data.parallel import processes
from finetune.model.tokenizer import end_marker, render_chat
from finetune.config.schema import Experiment
from finetune.config.derived.effective import value
from finetune.errors import DataError
from finetune.methods import Job


def _ids(tokenizer, value: str | list, end: str, where: str) -> list[int]:
    if isinstance(value, list):
        return render_chat(tokenizer, value, where)
    if end and not value.endswith(end):
        value += end
    return tokenizer(value)["input_ids"]


END_NOTE = ("reward: no EOS appended to plain texts: the tokenizer frames each text with "
            "its own special tokens (an encoder's [CLS] ... [SEP]) and the head reads those")


def _tokenized(dataset, tokenizer, max_length: int | None, split: str = "train",
               num_proc: int | None = None):
    end = end_marker(tokenizer)

    def one(row: dict[str, Any]) -> dict[str, Any]:
        prompt = row.get("prompt") or ([] if isinstance(row["chosen"], list) else "")
        head = "prompt + " if row.get("prompt") else ""
        return {f"{answer}_ids": _ids(tokenizer, prompt + row[answer], end,
                                      f"{row.get(ORIGIN, f'data.{split}')}, `{head}{answer}`")
                for answer in ("chosen", "rejected")}

    dataset = dataset.map(one, remove_columns=[c for c in ("prompt", "chosen", "rejected")
                                               if c in dataset.column_names],
                          num_proc=num_proc, desc="tokenizing")
    if max_length is None:
        return dataset
    # As RewardTrainer: a pair longer than max_length is dropped; none left is an error.
    kept = dataset.filter(lambda row: len(row["chosen_ids"]) <= max_length
                          and len(row["rejected_ids"]) <= max_length)
    if len(kept) == 0:
        longest = [max(len(c), len(r)) for c, r in zip(dataset["chosen_ids"],
                                                       dataset["rejected_ids"])]
        shortest = min(range(len(longest)), key=longest.__getitem__)
        where = dataset[shortest].get(ORIGIN, f"data.{split} row {shortest + 1}")
        raise DataError(f"data.{split}: no pair fits training.max_length {max_length}: "
                        "RewardTrainer drops a pair whose chosen or rejected is longer, and "
                        f"the shortest, {where}, has "
                        f"{longest[shortest]} tokens; raise training.max_length, or shorten "
                        "the texts")
    return kept


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    max_length = value(experiment, "max_length")
    return splits.tokenized(lambda rows, split: _tokenized(
        rows, tokenizer, max_length, split, processes(experiment, len(rows))))


def build_trainer(job: Job) -> RewardTrainer:
    if not end_marker(job.tokenizer):  # the encoder's choice, said in the start summary
        job.notes.append(END_NOTE)
    kwargs = dict(model=job.model, args=job.args, train_dataset=job.data.train,
                  eval_dataset=job.data.eval, processing_class=job.tokenizer,
                  callbacks=job.callbacks)
    if job.experiment.data.weight_column is None:
        return RewardTrainer(**kwargs)
    from finetune.trainers.weighted import WeightedRewardTrainer

    return WeightedRewardTrainer(**kwargs)
