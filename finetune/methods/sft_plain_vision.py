"""sft of a vision-language model on plain prompt/completion rows with pictures (`prompt`
and `completion` text, `images`): VQA files, captions, and PaliGemma's own format (a
task prefix such as "caption en", the answer as suffix), which has no chat template.

TRL 1.16's vision collator encodes the completion through the processor without
pictures (PaliGemma's processor refuses that), adds no EOS to a plain completion (the
model would never learn to stop) and marks PaliGemma's completion as prefix (attended
both ways: each answer token would see the ones after it). PlainPictures collates such
rows as a text model's plain prompt/completion is tokenized (data/sft_tokens.py): the
prompt with its pictures through the processor, led by BOS (model/vision.plain_prompts,
which generation uses too), the completion through the tokenizer with EOS; the prompt's
tokens untrained unless training.completion_only_loss is false; for PaliGemma the
completion's token_type_ids 1 (its causal suffix)."""

from __future__ import annotations

from finetune.data.images import IMAGES
from finetune.model.vision import plain_prompts, prefix_lm


def completion_ids(tokenizer, completion: str) -> list[int]:
    ids = tokenizer(completion, add_special_tokens=False)["input_ids"]
    return ids if ids and ids[-1] == tokenizer.eos_token_id else ids + [tokenizer.eos_token_id]


class PlainPictures:
    """The collator of plain prompt/completion rows with pictures (module docstring):
    input_ids, attention_mask, labels and what the processor gives the model (pixel
    values, token_type_ids, ...), flushed left and cut at max_length."""

    def __init__(self, processor, max_length: int | None, completion_only: bool):
        self.processor, self.max_length = processor, max_length
        self.completion_only = completion_only
        self.suffix_type = 1 if prefix_lm(processor) else 0  # PaliGemma: the causal suffix

    def __call__(self, rows):
        import torch
        from trl.trainer.utils import flush_left

        tokenizer = self.processor.tokenizer
        batch = plain_prompts(self.processor, [row["prompt"] for row in rows],
                              [row.get(IMAGES) or [] for row in rows])
        answers = [completion_ids(tokenizer, row["completion"]) for row in rows]
        width = max(len(ids) for ids in answers)
        answer_ids = torch.tensor([ids + [tokenizer.pad_token_id] * (width - len(ids))
                                   for ids in answers])
        answer_mask = torch.tensor([[1] * len(ids) + [0] * (width - len(ids))
                                    for ids in answers])
        prompt_mask = batch["attention_mask"]
        input_ids = torch.cat((batch["input_ids"], answer_ids), dim=1)
        mask = torch.cat((prompt_mask, answer_mask), dim=1)
        is_answer = torch.cat((torch.zeros_like(prompt_mask), answer_mask), dim=1)
        types = {key: torch.cat((batch[key], torch.full_like(answer_ids, fill)), dim=1)
                 for key, fill in (("token_type_ids", self.suffix_type),
                                   ("mm_token_type_ids", 0)) if key in batch}
        mask, input_ids, is_answer, *typed = flush_left(mask, input_ids, is_answer,
                                                         *types.values())
        columns = {"input_ids": input_ids, "attention_mask": mask, "is_answer": is_answer,
                   **dict(zip(types, typed))}
        if self.max_length is not None:
            columns = {k: v[:, :self.max_length] for k, v in columns.items()}
        is_answer = columns.pop("is_answer")
        labels = columns["input_ids"].clone()
        labels[columns["attention_mask"] == 0] = -100
        if self.completion_only:
            labels[is_answer == 0] = -100
        batch.update(columns, labels=labels)
        return batch
