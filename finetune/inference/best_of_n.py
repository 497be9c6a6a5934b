"""`finetune generate --best-of N`: N sampled completions per prompt, scored by a reward
(reward_sources.py), written as preference rows that `method: dpo` and `method: reward`
read as they are: one step of rejection-sampling fine-tuning (generate, then train on
the rows).

A row is {"prompt", "chosen", "rejected", "chosen_score", "rejected_score", "scores"}
plus the prompts file's other columns. `prompt` is what the model was prompted with: a
conversation (a plain text prompt is the user turn the chat template wrapped it in)
with chosen and rejected as assistant turns, or, under --raw, the text as given with
text completions; so a dpo run on the rows trains on what was sampled. chosen is the
best-scored sample (the first of equals); rejected the worst (--pairs best-worst) or,
with --pairs all, each sample scored below the best, one row each. A prompt whose N
samples all score the same has no preference and is skipped (counted on stderr).

Scores are the weighted sum of the sources, as grpo and ppo compute them: the reward
model reads prompt + completion (a conversation through its tokenizer's chat template),
a function is called as f(prompts=, completions=, completion_ids=, trainer_state=None,
**columns) and returns one number per completion.

A vision-language model samples each prompt with its pictures (as `finetune generate`),
scored by reward functions only; its rows carry the prompt's `images`, as dpo on a
vision-language model reads them.
"""

from __future__ import annotations

import json
import sys
from typing import TextIO

import torch

from finetune.data.image_size import fitter
from finetune.errors import DataError, RunError, first_line
from finetune.inference.generate import (batches, encoded_with_images, new_tokens, plain,
                                         token_ids, vision_ids)
from finetune.model.saved import device, dtype_of, load_model, load_tokenizer, locate, require_lm
from finetune.model.vision import is_processor, text_tokenizer
from finetune.inference.prompts import Prompt
from finetune.inference.reward_sources import RewardSources
from finetune.trainers.ppo_rollout import Rewards

OWN_COLUMNS = ("prompt", "chosen", "rejected", "chosen_score", "rejected_score", "scores")


def scorer(sources: RewardSources, experiment, dtype: torch.dtype, on: str) -> Rewards:
    """The weighted reward of `sources`, its model (if any) loaded on `on`."""
    model = tokenizer = None
    if sources.model is not None:
        from finetune.config.method_sections import RewardsSection
        from finetune.model.rewards import reward_model

        spec = experiment.model_copy(update={"rewards": RewardsSection(model=sources.model)})
        try:
            model, tokenizer = reward_model(spec, dtype)
        except OSError as exc:
            raise RunError(f"{sources.where}: cannot load the reward model {sources.model}: "
                           f"{first_line(exc)}") from None
        model.to(on)
    return Rewards(sources.callables, sources.functions, sources.weights, model, tokenizer)


def written_prompt(prompt: Prompt, tokenizer, raw: bool) -> str | list[dict]:
    """The prompt as the model saw it: a conversation, or (raw, or no chat template) text."""
    if prompt.messages is not None:
        return prompt.messages
    if raw or not tokenizer.chat_template:
        return prompt.text
    return [{"role": "user", "content": prompt.text}]


def padded(tokenizer, batch: list[list[int]]) -> dict[str, torch.Tensor]:
    """Token-id prompts as one left-padded batch."""
    width, pad = max(len(ids) for ids in batch), tokenizer.pad_token_id
    return {"input_ids": torch.tensor([[pad] * (width - len(ids)) + ids for ids in batch]),
            "attention_mask": torch.tensor([[0] * (width - len(ids)) + [1] * len(ids)
                                            for ids in batch])}


@torch.no_grad()
def sample(model, tokenizer, inputs, n: int, max_new_tokens: int, temperature: float,
           top_p: float, top_k: int | None) -> tuple[list[str], list[list[int]]]:
    """n sampled completions per prompt of a left-padded batch (padded, or a processor's
    batch with its pictures; prompt i's are rows i*n .. i*n+n-1): texts and token ids up
    to and including the end-of-sequence token."""
    tokenizer = text_tokenizer(tokenizer)
    width = inputs["input_ids"].shape[1]
    extra = {"top_k": top_k} if top_k is not None else {}
    out = model.generate(**{k: v.to(model.device) for k, v in inputs.items()},
                         max_new_tokens=max_new_tokens, pad_token_id=tokenizer.pad_token_id,
                         use_cache=True, do_sample=True, temperature=temperature, top_p=top_p,
                         num_return_sequences=n, **extra)
    ids = []
    for row in out[:, width:].tolist():
        end = row.index(tokenizer.eos_token_id) + 1 if tokenizer.eos_token_id in row else len(row)
        ids.append(row[:end])
    return tokenizer.batch_decode(ids, skip_special_tokens=True), ids


def preference_rows(prompt: Prompt, shown, texts: list[str], scores: list[float],
                    pairs: str) -> list[dict]:
    """The rows of one prompt's samples; none when every score is the same."""
    best = max(range(len(scores)), key=lambda i: (scores[i], -i))  # the first of equals
    worst = min(range(len(scores)), key=lambda i: (scores[i], i))
    if scores[best] == scores[worst]:
        return []
    losers = [worst] if pairs == "best-worst" else \
        [i for i in range(len(scores)) if scores[i] < scores[best]]
    as_turn = (lambda t: [{"role": "assistant", "content": t}]) if isinstance(shown, list) \
        else (lambda t: t)
    extra = {k: v for k, v in prompt.columns.items() if k not in OWN_COLUMNS}
    if prompt.reference is not None and "reference" not in extra:
        extra["reference"] = prompt.reference
    if prompt.images:  # the pictures the samples answered (absolute paths)
        extra["images"] = prompt.images
    return [{"prompt": shown, "chosen": as_turn(texts[best]), "rejected": as_turn(texts[i]),
             "chosen_score": scores[best], "rejected_score": scores[i], "scores": scores,
             **extra} for i in losers]


def _require_conversations(prompts: list[Prompt], processor, sources: RewardSources,
                           raw: bool) -> None:
    """A vision-language model's samples are scored by reward functions and written as
    conversations: a reward model reads text (it would score answers about pictures it
    cannot see), and preference rows with pictures are conversations (data/rows.py)."""
    if sources.model is not None:
        raise RunError(f"{sources.where}: the reward model {sources.model} reads text, and the "
                       "samples answer pictures it cannot see: score a vision-language "
                       "model's samples with reward functions")
    for prompt in prompts:
        if plain(prompt, processor, raw):
            raise DataError(f"{prompt.where}: --best-of writes a vision-language model's "
                            "rows as conversations (dpo takes pictures with those only): "
                            + ("leave --raw out" if raw else "the run's processor has no "
                               "chat template"))


def best_of_n(run_dir: str, prompts: list[Prompt], out: TextIO, sources: RewardSources, *,
              n: int, pairs: str, model_choice: str | None, max_new_tokens: int,
              temperature: float, top_p: float, top_k: int | None, seed: int, raw: bool,
              batch_size: int, dtype: str) -> tuple[int, int]:
    """Writes the preference rows; returns (rows written, prompts skipped as ties)."""
    run = locate(run_dir, model_choice)
    require_lm(run, "generate --best-of")
    tokenizer = load_tokenizer(run)  # a vision-language model's processor
    fit, pictures = fitter(run.experiment), is_processor(tokenizer)
    if pictures:
        _require_conversations(prompts, tokenizer, sources, raw)
        encoded = [vision_ids(p, tokenizer, raw, fit) for p in prompts]  # each checked first
    else:
        encoded = [token_ids(p, tokenizer, raw) for p in prompts]
    shown = [written_prompt(p, text_tokenizer(tokenizer), raw) for p in prompts]
    on = device()
    model = load_model(run, tokenizer, dtype_of(dtype, on), on)
    rewards = scorer(sources, run.experiment, dtype_of(dtype, on), on)
    budgets = [new_tokens(model, len(ids), max_new_tokens, p.where)
               for p, ids in zip(prompts, encoded)]
    torch.manual_seed(seed)
    written = ties = 0
    for chunk in batches(list(zip(prompts, shown, encoded, budgets)), batch_size):
        inputs = encoded_with_images(tokenizer, [c[0] for c in chunk], raw, fit) if pictures \
            else padded(tokenizer, [c[2] for c in chunk])
        texts, ids = sample(model, tokenizer, inputs, n, min(c[3] for c in chunk), temperature,
                            top_p, top_k)
        repeated = [c for c in chunk for _ in range(n)]
        keys = sorted({k for c in chunk for k in c[0].columns})
        columns = {k: [c[0].columns.get(k) for c in repeated] for k in keys}
        totals, _ = rewards([c[1] for c in repeated], texts, ids, columns, on, len(texts))
        scores = totals.tolist()
        for i, (prompt, given, _, _) in enumerate(chunk):
            rows = preference_rows(prompt, given, texts[i * n:(i + 1) * n],
                                   scores[i * n:(i + 1) * n], pairs)
            ties += not rows
            for row in rows:
                out.write(json.dumps(row, ensure_ascii=False) + "\n")
            written += len(rows)
        out.flush()
    print(f"finetune: best of {n}: {written} preference row(s) from {len(prompts)} prompt(s) "
          f"of {run.directory}, scored by {sources.describe()}"
          + (f"; {ties} prompt(s) skipped: their {n} samples all scored the same" if ties
             else ""), file=sys.stderr)
    if ties:  # what a dpo or reward run on this file then learns from
        print(f"finetune: warning: only {len(prompts) - ties} of {len(prompts)} prompt(s) gave a "
              f"pair: a preference run on these {written} row(s) learns from "
              f"{100 * (len(prompts) - ties) / max(len(prompts), 1):.0f}% of the prompts; more "
              "samples (--best-of), a higher temperature or another reward separate more",
              file=sys.stderr)
    return written, ties
