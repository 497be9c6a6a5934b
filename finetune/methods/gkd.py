"""Generalized knowledge distillation through TRL's GKDTrainer (trl.experimental.gkd).

The student learns the frozen teacher's next-token distribution (distill.teacher, loaded
by methods/teacher.py as for method distill) on the completions of each batch, under the
generalized Jensen-Shannon divergence of training.beta (0: forward KL(teacher||student),
1: reverse KL, 0.5 TRL's default: JSD). Which completions: with probability
training.lmbda a batch's are sampled from the student (on-policy, up to
training.max_new_tokens at training.temperature); otherwise the data's own, or with
training.seq_kd the teacher's samples. lmbda 0 without seq_kd is the supervised form,
KL on the teacher's logits over the data, no generation: as fast as a second forward
pass. The divergence itself is at temperature 1 (TRL's compute_loss); training.temperature
is only the sampling temperature.

Data: conversations (GKD's collator renders `messages` through the chat template: the
turns before the last are the prompt, the last, an assistant turn, the completion that
is trained on and that generation replaces); prompt/completion rows as message lists
become such a conversation. Text prompt/completion rows are refused: they have no turns
for the template, and rendering them as a chat would train on other text than the data's.

Loss normalisation: TRL divides the summed divergence by the global count of completion
tokens but, overriding compute_loss, skips the Trainer's scaling by the number of
processes that goes with that global count; the subclass adds it back, so 2 processes
take the step 1 process takes with the same global batch (tests/test_data_parallel.py;
without it the 2-process update is half as large). The count is the data's completion
tokens, taken before a batch's completions are replaced by sampled ones (TRL's order).

Exact resume: GKDTrainer is an SFTTrainer with the Trainer's own sampler (reseeded per
epoch); the on-policy draw is Python's `random`, whose state the checkpoint restores.
"""

from __future__ import annotations

from datasets import Dataset
from trl.experimental.gkd import GKDTrainer

from finetune.config.derived.effective import value
from finetune.config.schema import Experiment
from finetune.data.load import ORIGIN, Splits
from finetune.data.prompts import prompt_ids
from finetune.data.sft_tokens import uses_token_weights
from finetune.errors import ConfigError, DataError
from finetune.methods import Job
from finetune.methods.teacher import teacher_model
from finetune.model.tokenizer import render_chat


def _conversation(row: dict, fmt: str) -> list[dict]:
    """The row as a conversation ending in the assistant turn to be trained on."""
    where = row[ORIGIN]
    if row.get("tools"):
        raise DataError(f"{where}: `tools`: gkd renders the conversation without them "
                        "(TRL's GKD collator); remove them or use method sft")
    if fmt == "prompt_completion":
        prompt, completion = row["prompt"], row["completion"]
        if isinstance(prompt, str) or isinstance(completion, str):
            raise DataError(f"{where}: a text prompt/completion row: gkd reads conversations "
                            "(the chat template renders them); give `prompt` and "
                            "`completion` as message lists, or use `messages`")
        if len(completion) != 1 or completion[0]["role"] != "assistant":
            raise DataError(f"{where}: `completion`: gkd trains one assistant turn; this has "
                            f"{[m['role'] for m in completion]}")
        return prompt + completion
    messages = row["messages"]
    if len(messages) < 2 or messages[-1]["role"] != "assistant":
        raise DataError(f"{where}: `messages`: gkd trains the last turn, which must be an "
                        "assistant answer with at least one turn before it")
    return messages


def _checked(messages: list[dict], where: str, tokenizer, limit: int | None) -> None:
    """Rendered as the collator renders it; the completion alone must leave room for
    some prompt within max_length (the collator cuts the prompt's start, and fails on a
    row with no prompt left)."""
    whole = render_chat(tokenizer, messages, where)
    head = prompt_ids(tokenizer, messages[:-1], where)
    completion = len(whole) - len(head)
    if limit is not None and completion >= limit:
        raise DataError(f"{where}: the completion has {completion} tokens, filling "
                        f"training.max_length {limit} with no prompt left; raise "
                        "training.max_length or shorten the answer")


def _conversations(rows: Dataset | None, fmt: str, tokenizer, limit: int | None):
    if rows is None:
        return None
    out = []
    for row in rows:
        messages = _conversation(row, fmt)
        _checked(messages, row[ORIGIN], tokenizer, limit)
        out.append({"messages": messages, ORIGIN: row[ORIGIN]})
    return Dataset.from_list(out)


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    """Conversation rows (`messages` only), each rendered and checked against max_length."""
    if uses_token_weights(splits.train, splits.format):
        raise ConfigError(["data: `weight` on messages: gkd's loss has no per-token weights"])
    limit = value(experiment, "max_length")
    notes = splits.notes if splits.format == "messages" else [
        *splits.notes, "gkd: prompt/completion rows read as conversations (prompt + completion)"]
    return Splits(train=_conversations(splits.train, splits.format, tokenizer, limit),
                  eval=_conversations(splits.eval, splits.format, tokenizer, limit),
                  format="messages", mix=splits.mix, notes=notes)


class ProcessScaledGKDTrainer(GKDTrainer):
    """GKDTrainer whose loss over the global token count is scaled by the number of
    processes, as the Trainer's own compute_loss does (see the module doc)."""

    def compute_loss(self, model, inputs, return_outputs=False, num_items_in_batch=None):
        out = super().compute_loss(model, inputs, return_outputs, num_items_in_batch)
        if num_items_in_batch is None or not self.args.average_tokens_across_devices:
            return out
        scale = self.accelerator.num_processes
        return (out[0] * scale, out[1]) if return_outputs else out * scale


def build_trainer(job: Job) -> GKDTrainer:
    return ProcessScaledGKDTrainer(
        model=job.model, teacher_model=teacher_model(job), args=job.args,
        train_dataset=job.data.train, eval_dataset=job.data.eval,
        processing_class=job.tokenizer, callbacks=job.callbacks)
