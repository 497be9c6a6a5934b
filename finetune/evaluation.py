"""Generation-based evaluation: exact match of greedy answers on held-out prompts (sft)."""

from __future__ import annotations

from typing import Any

import torch
from datasets import Dataset


def _prompt_and_answer(row: dict[str, Any], fmt: str, tokenizer) -> tuple[str, str]:
    if fmt == "messages":
        messages = row["messages"]
        last = max(i for i, m in enumerate(messages) if m["role"] == "assistant")
        prompt = tokenizer.apply_chat_template(messages[:last], add_generation_prompt=True,
                                               tokenize=False)
        return prompt, messages[last]["content"]
    if isinstance(row["prompt"], list):  # conversational prompt/completion
        prompt = tokenizer.apply_chat_template(row["prompt"], add_generation_prompt=True,
                                               tokenize=False)
        return prompt, row["completion"][-1]["content"]
    return row["prompt"], row["completion"]


@torch.no_grad()
def exact_match(model, tokenizer, dataset: Dataset, fmt: str, max_new_tokens: int,
                max_samples: int, batch_size: int = 32) -> dict[str, Any]:
    rows = dataset.select(range(min(max_samples, len(dataset))))
    pairs = [_prompt_and_answer(row, fmt, tokenizer) for row in rows]
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
    device = next(model.parameters()).device
    hits, examples = 0, []
    try:
        for start in range(0, len(pairs), batch_size):
            batch = pairs[start:start + batch_size]
            enc = tokenizer([p for p, _ in batch], return_tensors="pt", padding=True,
                            add_special_tokens=False).to(device)
            out = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id)
            texts = tokenizer.batch_decode(out[:, enc["input_ids"].shape[1]:],
                                           skip_special_tokens=True)
            for (prompt, answer), text in zip(batch, texts):
                hit = text.strip() == answer.strip()
                hits += hit
                if len(examples) < 3:
                    examples.append({"prompt": prompt, "answer": answer, "generated": text.strip()})
    finally:
        tokenizer.padding_side = side
        model.train(was_training)
    return {"exact_match": hits / max(len(pairs), 1), "samples": len(pairs), "examples": examples}
