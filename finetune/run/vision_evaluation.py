"""Exact match of a vision-language model's greedy answers on held-out rows with images:
each prompt (the turns before the last assistant turn, or a prompt/completion row's
prompt, with its images) goes through the processor as the collator sends it in
training, and the answer is compared with the last assistant turn's text (the
completion's). evaluation.py calls it for a run whose processing class is a
processor."""

from __future__ import annotations

from typing import Any, Callable

import torch
from datasets import Dataset

from finetune.model.vision import chat_prompts, plain_prompts, with_images


def _text(content) -> str:
    if isinstance(content, str):
        return content
    return "".join(part.get("text") or "" for part in content if part.get("type") == "text")


def _prompt_and_answer(row: dict[str, Any]) -> tuple[list[dict[str, Any]] | str, list, str]:
    """(the prompt: the turns before the last assistant turn, or a prompt/completion
    row's prompt, plain or conversational; the row's images; the answer's text). All the
    images belong to the prompt: in TRL's format the answer holds none."""
    if "messages" not in row:
        completion = row["completion"]
        answer = completion if isinstance(completion, str) else \
            _text(completion[-1]["content"])
        return row["prompt"], row.get("images") or [], answer
    messages = row["messages"]
    last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
    return messages[:last], row.get("images") or [], _text(messages[last]["content"])


def encoded(processor, prompts: list, images: list[list], fit: Callable[[list], list]):
    """A batch of prompts as training encodes them: conversations through the chat
    template, plain texts as the plain collator lays them out (one file's rows are all one
    or the other)."""
    if isinstance(prompts[0], str):
        return plain_prompts(processor, prompts, images, fit)
    return chat_prompts(processor, prompts, images, fit)


@torch.no_grad()
def exact_match(model, processor, dataset: Dataset, max_new_tokens: int, max_samples: int,
                device: torch.device, batch_size: int = 32,
                fit: Callable[[list], list] = list) -> dict[str, Any]:
    """As evaluation.exact_match: greedy answers to the first max_samples prompts. fit: a
    row's images as the processor is to see them (vision.max_pixels/min_pixels, as in
    training: data/image_size.py)."""
    rows = dataset.select(range(min(max_samples, len(dataset))))
    triples = [_prompt_and_answer(row) for row in rows]
    tokenizer = processor.tokenizer
    was_training = model.training
    model.eval()
    hits, examples = 0, []
    try:
        for start in range(0, len(triples), batch_size):
            batch = triples[start:start + batch_size]
            enc = encoded(processor, [prompt for prompt, _, _ in batch],
                          [images for _, images, _ in batch], fit).to(device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                           skip_special_tokens=True)
            for (prompt, images, answer), text in zip(batch, texts):
                hit = text.strip() == answer.strip()
                hits += hit
                if len(examples) < 3:
                    rendered = prompt if isinstance(prompt, str) else \
                        processor.apply_chat_template(with_images(prompt, images),
                                                      add_generation_prompt=True,
                                                      tokenize=False)
                    examples.append({"prompt": rendered, "answer": answer,
                                     "generated": text.strip()})
    finally:
        model.train(was_training)
    return {"exact_match": hits / max(len(triples), 1), "samples": len(triples),
            "examples": examples}
