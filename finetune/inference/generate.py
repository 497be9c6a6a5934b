"""`finetune generate`: completions of a run's causal LM for prompts, one JSON object per
prompt ({"prompt", "completion", and "reference" where the row had an answer}).

Chat prompts (message lists, and plain texts unless --raw) go through the run's chat
template with the generation prompt; a plain text under --raw is tokenized as it is.
Greedy unless --temperature is above 0. Prompts are generated in batches, padded on the
left. A vision-language model's prompts (with their images) go through its processor: a
plain text under --raw, or for a model without a chat template (PaliGemma), as plain
prompt/completion rows train.
"""

from __future__ import annotations

import json
import sys
from functools import partial
from typing import Iterable, TextIO

import torch

from finetune.data.image_size import fitter
from finetune.errors import DataError
from finetune.model.saved import (device, dtype_of, load_model, load_tokenizer, locate,
                                     require_lm)
from finetune.inference.prompts import Prompt
from finetune.model.tokenizer import render_chat
from finetune.model.vision import (chat_prompts, encoded_prompt, is_processor, plain_prompts,
                                   text_tokenizer)


def token_ids(prompt: Prompt, tokenizer, raw: bool) -> list[int]:
    if prompt.images:
        raise DataError(f"{prompt.where}: the prompt has images, and the run's model is not a "
                        "vision-language model")
    if prompt.messages is None and (raw or not tokenizer.chat_template):
        return list(tokenizer(prompt.text, add_special_tokens=True)["input_ids"])
    messages = prompt.messages or [{"role": "user", "content": prompt.text}]
    if not tokenizer.chat_template:
        raise DataError(f"{prompt.where}: a conversation, and the run's tokenizer has no chat "
                        "template to render it")
    return render_chat(tokenizer, messages, prompt.where, generation_prompt=True)


def context_of(model) -> int | None:
    return getattr(model.config.get_text_config(), "max_position_embeddings", None)


def new_tokens(model, prompt_length: int, wanted: int, where: str) -> int:
    """max_new_tokens within the model's context; a prompt that fills it is an error."""
    context = context_of(model)
    if context is None:
        return wanted
    room = context - prompt_length
    if room <= 0:
        raise DataError(f"{where}: the prompt is {prompt_length} tokens, and the model's "
                        f"context (max_position_embeddings) is {context}")
    return min(wanted, room)


def sampling_options(temperature: float, top_p: float, top_k: int | None) -> dict:
    """generate()'s sampling arguments: greedy at temperature 0."""
    if temperature <= 0:
        return {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    return {"do_sample": True, "temperature": temperature, "top_p": top_p,
            **({"top_k": top_k} if top_k is not None else {})}


@torch.no_grad()
def complete(model, tokenizer, batch: list[list[int]], max_new_tokens: int,
             temperature: float, top_p: float, top_k: int | None = None) -> list[str]:
    """Completions of token-id prompts, left-padded into one batch."""
    width = max(len(ids) for ids in batch)
    pad = tokenizer.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch])
    mask = torch.tensor([[0] * (width - len(ids)) + [1] * len(ids) for ids in batch])
    sampling = sampling_options(temperature, top_p, top_k)
    out = model.generate(input_ids=input_ids.to(model.device),
                         attention_mask=mask.to(model.device), max_new_tokens=max_new_tokens,
                         pad_token_id=pad, use_cache=True, **sampling)
    return tokenizer.batch_decode(out[:, width:], skip_special_tokens=True)


def conversation(prompt: Prompt) -> list[dict]:
    return prompt.messages or [{"role": "user", "content": prompt.text}]


def plain(prompt: Prompt, processor, raw: bool) -> bool:
    """A vision-language model's plain prompt goes as written (its image placeholders
    where the processor expects them, as plain prompt/completion rows train: under --raw,
    or with no chat template); otherwise through the chat template, which places them."""
    return prompt.messages is None and (raw or not text_tokenizer(processor).chat_template)


def encoded_with_images(processor, batch: list[Prompt], raw: bool, fit=list):
    """A batch of prompts of one kind (plain) as the processor encodes them."""
    if all(plain(p, processor, raw) for p in batch):
        return plain_prompts(processor, [p.text for p in batch], [p.images for p in batch],
                             fit)
    return chat_prompts(processor, [conversation(p) for p in batch],
                        [p.images for p in batch], fit)


def vision_ids(prompt: Prompt, processor, raw: bool, fit=list) -> list[int]:
    """A vision-language model's prompt as its processor encodes it (each image expanded
    to its tokens); the processor's refusal of a plain prompt names the prompt."""
    if plain(prompt, processor, raw):
        return encoded_prompt(processor, prompt.text, prompt.images, prompt.where, fit)[
            "input_ids"][0].tolist()
    if not text_tokenizer(processor).chat_template:
        raise DataError(f"{prompt.where}: a conversation, and the run's processor has no "
                        "chat template to render it")
    return chat_prompts(processor, [conversation(prompt)], [prompt.images], fit)[
        "input_ids"][0].tolist()


@torch.no_grad()
def complete_with_images(model, processor, batch: list[Prompt], max_new_tokens: int,
                         temperature: float, top_p: float, top_k: int | None = None,
                         fit=list, raw: bool = False) -> list[str]:
    """Completions of a vision-language model: the prompts and their images through the
    processor as one left-padded batch, as in training (fit: vision.max_pixels); plain
    prompts and conversations (under --raw, both in one file) in a batch each."""
    kinds = [plain(p, processor, raw) for p in batch]
    if len(set(kinds)) > 1:
        texts = {kind: iter(complete_with_images(
            model, processor, [p for p, k in zip(batch, kinds) if k == kind], max_new_tokens,
            temperature, top_p, top_k, fit, raw)) for kind in (True, False)}
        return [next(texts[kind]) for kind in kinds]
    encoded = encoded_with_images(processor, batch, raw, fit).to(model.device)
    out = model.generate(**encoded, max_new_tokens=max_new_tokens,
                         pad_token_id=processor.tokenizer.pad_token_id, use_cache=True,
                         **sampling_options(temperature, top_p, top_k))
    return processor.tokenizer.batch_decode(out[:, encoded["input_ids"].shape[1]:],
                                            skip_special_tokens=True)


def batches(items: list, size: int) -> Iterable[list]:
    for start in range(0, len(items), size):
        yield items[start:start + size]


def generate(run_dir: str, prompts: list[Prompt], out: TextIO, *, model_choice: str | None,
             max_new_tokens: int, temperature: float, top_p: float, seed: int, raw: bool,
             batch_size: int, dtype: str, top_k: int | None = None) -> int:
    run = locate(run_dir, model_choice)
    require_lm(run, "generate")
    tokenizer = load_tokenizer(run)  # a vision-language model's processor
    images, fit = is_processor(tokenizer), fitter(run.experiment)
    encode = partial(vision_ids, fit=fit) if images else token_ids
    encoded = [encode(p, tokenizer, raw) for p in prompts]  # every row checked first
    on = device()
    model = load_model(run, tokenizer, dtype_of(dtype, on), on)
    budgets = [new_tokens(model, len(ids), max_new_tokens, p.where)
               for p, ids in zip(prompts, encoded)]
    torch.manual_seed(seed)
    written = 0
    for chunk in batches(list(zip(prompts, encoded, budgets)), batch_size):
        if images:
            texts = complete_with_images(model, tokenizer, [p for p, _, _ in chunk],
                                         min(b for _, _, b in chunk), temperature, top_p, top_k,
                                         fit, raw)
        else:
            texts = complete(model, tokenizer, [ids for _, ids, _ in chunk],
                             min(b for _, _, b in chunk), temperature, top_p, top_k)
        for (prompt, _, _), text in zip(chunk, texts):
            row = {"prompt": prompt.given(), "completion": text}
            if prompt.images:
                row["images"] = prompt.images  # absolute: the pictures the model saw
            if prompt.reference is not None:
                row["reference"] = prompt.reference
            out.write(json.dumps(row, ensure_ascii=False) + "\n")
            written += 1
        out.flush()
    if out is not sys.stdout:
        print(f"finetune: {written} completion(s) from {run.directory}", file=sys.stderr)
    return written
