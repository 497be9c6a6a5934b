"""What a PPO rollout needs besides the models: the prompt sampler, prompts rendered and
left-padded, sampling with stop strings, the response masks, and the reward sources."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
from torch.utils.data import Sampler

from finetune.model.rewards import reward_call_error, reward_problem, unique_names
from finetune.errors import RunError


class RolloutSampler(Sampler):
    """Yields dataset indices so that each dataloader batch is a whole per-process rollout
    (P prompts), repeated `repeat` times (one per micro-step of the rollout's cycle).

    The permutation is drawn from seed + epoch (set_epoch), so it is the same after a
    resume. Each chunk of world x P indices is repeated as a block; the dataloader's
    per-process sharding (accelerate) hands batch k of the stream to rank k % world, so
    rank r gets its own P distinct prompts of every chunk, `repeat` times in a row.
    Incomplete chunks are dropped."""

    def __init__(self, size: int, chunk: int, repeat: int, seed: int, shuffle: bool = True):
        self.size, self.chunk, self.repeat = size, chunk, repeat
        self.seed, self.shuffle = seed, shuffle
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        if self.shuffle:
            generator = torch.Generator().manual_seed(self.seed + self.epoch)
            order = torch.randperm(self.size, generator=generator).tolist()
        else:
            order = list(range(self.size))
        for start in range(0, self.size - self.chunk + 1, self.chunk):
            block = order[start:start + self.chunk]
            for _ in range(self.repeat):
                yield from block

    def __len__(self) -> int:
        return (self.size // self.chunk) * self.chunk * self.repeat


def conversational(prompt: Any) -> bool:
    return isinstance(prompt, list)


def render(tokenizer, prompts: list) -> list[str]:
    """Message lists through the chat template with the generation prompt; text as is."""
    return [tokenizer.apply_chat_template(p, tokenize=False, add_generation_prompt=True)
            if conversational(p) else p for p in prompts]


def tokenize_prompts(tokenizer, prompts: list, device) -> tuple[torch.Tensor, torch.Tensor]:
    """Left-padded ids and mask. A chat template writes its own special tokens; plain text
    gets the tokenizer's (BOS, if it adds one)."""
    texts = render(tokenizer, prompts)
    encoded = tokenizer(texts, padding=True, padding_side="left", return_tensors="pt",
                        add_special_tokens=not conversational(prompts[0]))
    return encoded["input_ids"].to(device), encoded["attention_mask"].to(device)


def eos_ids(tokenizer, model) -> list[int]:
    ids = set()
    if tokenizer.eos_token_id is not None:
        ids.add(int(tokenizer.eos_token_id))
    config_ids = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    if isinstance(config_ids, int):
        ids.add(config_ids)
    elif config_ids:
        ids.update(int(i) for i in config_ids)
    return sorted(ids)


def sample(policy, tokenizer, input_ids, attention_mask, spec, eos: list[int]) -> torch.Tensor:
    """Response tokens [B, T] (T <= max_new_tokens), sampled from the policy with the
    rollout settings only (a model's own generation_config defaults, top_k 50 say, do not
    apply)."""
    from transformers import GenerationConfig

    config = GenerationConfig(
        do_sample=True, temperature=spec.temperature, top_k=spec.top_k or 0, top_p=spec.top_p,
        max_new_tokens=spec.max_new_tokens, min_new_tokens=0, eos_token_id=eos,
        repetition_penalty=1.0, no_repeat_ngram_size=0, typical_p=1.0, min_p=0.0,
        epsilon_cutoff=0.0, eta_cutoff=0.0,
        pad_token_id=tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0],
        bos_token_id=tokenizer.bos_token_id, use_cache=True,
        stop_strings=list(spec.stop_strings) or None)
    kwargs = {"tokenizer": tokenizer} if spec.stop_strings else {}
    out = policy.generate(input_ids=input_ids, attention_mask=attention_mask,
                          generation_config=config, **kwargs)
    return out[:, input_ids.shape[1]:]


@dataclass
class Responses:
    ids: torch.Tensor        # [B, T], pad after each response's end
    mask: torch.Tensor       # [B, T], 1 on the response's tokens (its EOS or stop included)
    ended: list[bool]        # ended with EOS or a stop string (else cut by max_new_tokens)
    texts: list[str]         # decoded, special tokens skipped, cut after a stop string


def finish(tokenizer, tokens: torch.Tensor, eos: list[int], stop_strings: list[str]
           ) -> Responses:
    """Find where each response ends (first EOS, or the token that completes a stop
    string), mask what follows and trim the batch to its longest response."""
    rows = tokens.tolist()
    ends, ended, texts = [], [], []
    eos_set = set(eos)
    for row in rows:
        end, done = len(row) - 1, False
        for i, token in enumerate(row):
            if token in eos_set:
                end, done = i, True
                break
            # generate's stop-string check reads the tokens' text, special tokens included
            if stop_strings and any(s in tokenizer.decode(row[:i + 1]) for s in stop_strings):
                end, done = i, True
                break
        text = tokenizer.decode(row[:end + 1], skip_special_tokens=True)
        hits = [(text.find(s), s) for s in stop_strings if s in text]
        if hits:
            at, stop = min(hits)
            text = text[:at + len(stop)]
        ends.append(end)
        ended.append(done)
        texts.append(text)
    width = max(ends) + 1
    positions = torch.arange(width, device=tokens.device)
    mask = (positions[None, :] <= torch.tensor(ends, device=tokens.device)[:, None]).long()
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else eos[0]
    ids = torch.where(mask.bool(), tokens[:, :width], torch.full_like(tokens[:, :width], pad))
    return Responses(ids=ids, mask=mask, ended=ended, texts=texts)


def sequences(prompt_ids, prompt_mask, responses: Responses):
    """Whole rows: ids, attention mask and the position ids generate used."""
    ids = torch.cat([prompt_ids, responses.ids], dim=1)
    mask = torch.cat([prompt_mask, responses.mask.to(prompt_mask.dtype)], dim=1)
    positions = (mask.cumsum(-1) - 1).clamp(min=0)
    return ids, mask, positions


def token_logprobs(logits: torch.Tensor, tokens: torch.Tensor, temperature: float
                   ) -> torch.Tensor:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return logp.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def token_entropy(logits: torch.Tensor, temperature: float) -> torch.Tensor:
    logp = torch.log_softmax(logits.float() / temperature, dim=-1)
    return -(logp.exp() * logp).sum(-1)


class Rewards:
    """The weighted sum of rewards.model and rewards.functions for a batch of completions.
    A function gets prompts and completions as text, or as message lists for
    conversational prompts (like TRL's GRPO reward functions), the completion token ids,
    the trainer state and every other column of the data, and returns one number per
    completion; anything else (None included: PPO needs every completion scored) stops
    the run with an error naming rewards.functions[i]."""

    def __init__(self, functions: list[Callable], specs: list[str], weights: list[float],
                 model=None, model_tokenizer=None):
        self.functions, self.weights = functions, weights
        self.names = unique_names([spec.rpartition(":")[2] for spec in specs])
        self.wheres = [f"rewards.functions[{i}] ({spec})" for i, spec in enumerate(specs)]
        self.model, self.model_tokenizer = model, model_tokenizer

    @property
    def sources(self) -> list[str]:
        return (["model"] if self.model is not None else []) + self.names

    def _model_scores(self, prompts: list, texts: list[str], device, batch: int) -> list[float]:
        tokenizer = self.model_tokenizer
        full = []
        for prompt, text in zip(prompts, texts):
            if conversational(prompt):
                full.append(tokenizer.apply_chat_template(
                    prompt + [{"role": "assistant", "content": text}], tokenize=False))
            else:
                full.append(prompt + text)
        scores = []
        for start in range(0, len(full), batch):
            encoded = tokenizer(full[start:start + batch], padding=True, return_tensors="pt",
                                add_special_tokens=not conversational(prompts[0]))
            with torch.no_grad():
                logits = self.model(input_ids=encoded["input_ids"].to(device),
                                    attention_mask=encoded["attention_mask"].to(device)).logits
            scores.extend(logits[:, 0].float().tolist())
        return scores

    def __call__(self, prompts: list, texts: list[str], completion_ids: list[list[int]],
                 columns: dict[str, list], device, batch: int, trainer_state=None
                 ) -> tuple[torch.Tensor, dict[str, float]]:
        """(weighted score per completion [B], sum per source for the logs)."""
        per_source = []
        if self.model is not None:
            per_source.append(self._model_scores(prompts, texts, device, batch))
        completions = [[{"role": "assistant", "content": t}] if conversational(p) else t
                       for p, t in zip(prompts, texts)]
        for function, where in zip(self.functions, self.wheres):
            try:
                values = function(prompts=prompts, completions=completions,
                                  completion_ids=completion_ids, trainer_state=trainer_state,
                                  **columns)
            except RunError:
                raise
            except Exception as exc:  # the user's code: say whose
                raise reward_call_error(exc, where) from exc
            problem = reward_problem(values, len(texts), allow_none=False)
            if problem:
                raise RunError(f"{where}: {problem}")
            per_source.append([float(v) for v in (values.tolist() if isinstance(
                values, torch.Tensor) else values)])
        stacked = torch.tensor(per_source, dtype=torch.float32)  # [sources, B]
        weights = torch.tensor(self.weights, dtype=torch.float32)[:, None]
        totals = {f"ppo/rewards/{name}": float(s.sum())
                  for name, s in zip(self.sources, stacked)}
        return (stacked * weights).sum(0).to(device), totals
