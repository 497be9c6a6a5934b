"""Evaluating a built trainer on its eval data, as training does before and after and as
`finetune eval` does: the method trainer's own evaluate(), plus exact match of greedy
answers on held-out prompts (sft, evaluation.exact_match)."""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from datasets import Dataset

from finetune.model.vision import is_processor
from finetune.data.image_size import fitter
from finetune.run import vision_evaluation


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
                max_samples: int, device: torch.device, batch_size: int = 32) -> dict[str, Any]:
    """Greedy answers to the first max_samples prompts, compared with their answers.
    device: where the model computes, which is not where its parameters live when they
    are offloaded (FSDP cpu_offload keeps them on the CPU between uses)."""
    rows = dataset.select(range(min(max_samples, len(dataset))))
    pairs = [_prompt_and_answer(row, fmt, tokenizer) for row in rows]
    was_training, side = model.training, tokenizer.padding_side
    model.eval()
    tokenizer.padding_side = "left"
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


def _generating(trainer):
    """FSDP1 leaves its root unit's parameters (embeddings, head) sharded outside its own
    forward, and generate() bypasses that forward: gather them while generating. FSDP2's
    generate is an FSDP forward already (the Trainer registers it)."""
    plugin = getattr(trainer.accelerator.state, "fsdp_plugin", None)
    if plugin is None or plugin.fsdp_version != 1:
        return contextlib.nullcontext()
    from torch.distributed.fsdp import FullyShardedDataParallel

    return FullyShardedDataParallel.summon_full_params(trainer.model_wrapped, recurse=False,
                                                       writeback=False)


def evaluate(trainer, job) -> tuple[dict[str, Any], dict[str, Any] | None]:
    """(the metrics, the exact-match details or None): the trainer's evaluate() on the
    job's eval data, with eval_exact_match added where the experiment asks for it.
    ({}, None) without eval data."""
    if job.data.eval is None:
        return {}, None
    results = dict(trainer.evaluate())
    spec = job.experiment.evaluation
    if not spec.exact_match:
        return results, None
    with _generating(trainer):
        if is_processor(job.tokenizer):  # a vision-language model: prompts with images
            scored = vision_evaluation.exact_match(
                trainer.model, job.tokenizer, job.data.eval_examples, spec.max_new_tokens,
                spec.max_samples, trainer.args.device, fit=fitter(job.experiment))
        else:
            scored = exact_match(trainer.model, job.tokenizer, job.data.eval_examples,
                                 job.data.format, spec.max_new_tokens, spec.max_samples,
                                 trainer.args.device)
    results["eval_exact_match"] = scored["exact_match"]
    return results, scored
