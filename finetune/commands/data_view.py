"""`finetune data`: what training will see of the data. A few rows as the model gets them
(the chat template applied, trained tokens between ⟦ and ⟧), the distribution of token
lengths, and how many rows truncation cuts and the max length drops, computed as each
method's preparation does (data/sft_tokens.py, methods/reward.py, methods/dpo.py)."""

from __future__ import annotations

import dataclasses
from typing import Iterator

from finetune.config.derived.effective import record, value
from finetune.config.schema import Experiment
from finetune.data.load import ORIGIN, load_data
from finetune.data.parallel import processes
from finetune.data.prompts import prompt_ids
from finetune.model.tokenizer import render_chat, require_chat_template

OPEN, CLOSE = "⟦", "⟧"
# data.streaming: the rows of an endless stream summarised, the first ones training reads.
STREAM_ROWS = 1000


@dataclasses.dataclass
class Sample:
    where: str
    parts: list[tuple[str, list[int], list[bool]]]  # (name, ids, trained?) per sequence
    dropped: bool = False  # the method's preparation drops it

    @property
    def length(self) -> int:
        return max(len(ids) for _, ids, _ in self.parts)


def marked(tokenizer, ids: list[int], trained: list[bool]) -> str:
    """The decoded text, each run of trained tokens between OPEN and CLOSE."""
    out, start = [], 0
    for end in range(1, len(ids) + 1):
        if end == len(ids) or trained[end] != trained[start]:
            text = tokenizer.decode(ids[start:end])
            out.append(f"{OPEN}{text}{CLOSE}" if trained[start] else text)
            start = end
    return "".join(out)


def _sft(rows, tokenizer, experiment: Experiment, splits, split: str) -> Iterator[Sample]:
    from finetune.data import sft_tokens
    from finetune.methods.sft import _masking

    masking = dataclasses.replace(_masking(splits, experiment), max_length=None, weighted=False)
    whole = sft_tokens.tokenize(rows, tokenizer, splits.format, masking, split)
    limit, keep_end = value(experiment, "max_length"), value(experiment, "truncation_mode") == \
        "keep_end"
    for origin, tokens in zip(rows[ORIGIN], whole):
        ids, trained = tokens["input_ids"], [t != -100 for t in tokens["labels"]]
        cut = slice(-limit, None) if keep_end else slice(None, limit)
        dropped = limit is not None and not any(trained[cut])
        yield Sample(origin, [("", ids, trained)], dropped)


def _sft_vision(rows, processor, experiment: Experiment, splits, split: str) -> Iterator[Sample]:
    """Rows with images as TRL's vision collator makes them in training (the processor
    expands each image to its tokens), one row at a time and uncut; assistant turns found
    as training finds them (methods/vision_turns.py)."""
    from trl.trainer.sft_trainer import DataCollatorForVisionLanguageModeling

    from finetune.data.image_size import ImagesSized, fitter
    from finetune.methods.sft import assistant_only
    from finetune.methods.sft_plain_vision import PlainPictures
    from finetune.methods.sft_vision import FORMATS, ImageTokensUntrained
    from finetune.methods.vision_lengths import measure
    from finetune.methods.vision_turns import SPANS, TurnsTrained, turns_of

    completion_only = value(experiment, "completion_only_loss") is not False
    turns, by_prefixes = turns_of(processor), False
    if splits.format == "prompt_completion" and isinstance(rows[0]["prompt"], str):
        collate = PlainPictures(processor, None, completion_only)
    elif splits.format == "prompt_completion":
        collate = DataCollatorForVisionLanguageModeling(processor,
                                                        completion_only_loss=completion_only)
    else:
        marked = assistant_only(experiment, "messages")
        by_prefixes = marked and turns.by_prefixes
        collate = DataCollatorForVisionLanguageModeling(
            processor, assistant_only_loss=marked and not by_prefixes,
            chat_template=turns.template)
    collate = ImageTokensUntrained(ImagesSized(collate, experiment), processor)  # as training
    if by_prefixes:
        collate = TurnsTrained(collate)
    limit, fit = value(experiment, "max_length"), fitter(experiment)
    for row in rows:
        given = {**{c: row[c] for c in FORMATS[splits.format] if c != "images"},
                 "images": row.get("images") or []}
        if by_prefixes:
            given[SPANS] = measure(processor, row["messages"], given["images"], True, fit,
                                   turns, row[ORIGIN]).spans
        batch = collate([given])
        ids, trained = batch["input_ids"][0].tolist(), (batch["labels"][0] != -100).tolist()
        yield Sample(row[ORIGIN], [("", ids, trained)],
                     limit is not None and not any(trained[:limit]))


def in_processes(sample, rows, processor, experiment: Experiment, splits, split: str,
                 num_proc: int | None) -> Iterator[Sample]:
    """A vision view's samples, in order, made in num_proc processes where the rows are
    many (every picture goes through the image processor: tens of ms a photo), as
    preparing measures them (methods/vision_lengths.py)."""
    from datasets import Dataset

    if num_proc is None:
        yield from sample(rows, processor, experiment, splits, split)
        return

    def shard(batch):
        done = list(sample(Dataset.from_dict(batch, features=rows.features), processor,
                           experiment, splits, split))
        return {"where": [s.where for s in done], "dropped": [s.dropped for s in done],
                "parts": [[{"name": n, "ids": i, "trained": t} for n, i, t in s.parts]
                          for s in done]}

    made = rows.map(shard, batched=True, num_proc=num_proc, remove_columns=rows.column_names,
                    load_from_cache_file=False, keep_in_memory=True,
                    desc=f"rendering data.{split}")
    for row in made:
        parts = [(p["name"], p["ids"], p["trained"]) for p in row["parts"]]
        yield Sample(row["where"], parts, row["dropped"])


def _reward(rows, tokenizer, experiment: Experiment, splits, split: str) -> Iterator[Sample]:
    from finetune.methods.reward import _tokenized

    limit = value(experiment, "max_length")
    for origin, pair in zip(rows[ORIGIN], _tokenized(rows, tokenizer, None, split)):
        parts = [(name, pair[f"{name}_ids"], [True] * len(pair[f"{name}_ids"]))
                 for name in ("chosen", "rejected")]
        sample = Sample(origin, parts)
        sample.dropped = limit is not None and sample.length > limit
        yield sample


def _dpo(rows, tokenizer, experiment: Experiment, splits, split: str) -> Iterator[Sample]:
    from trl.data_utils import extract_prompt

    limit = value(experiment, "max_length")
    # dpo drops a pair whose prompt alone fills max_length (keep_start); orpo/cpo/simpo,
    # without truncation_mode, refuse it while preparing (methods/pairs.py).
    keep_start = value(experiment, "truncation_mode", default=None) == "keep_start"
    for row in rows:
        if "prompt" not in row or row["prompt"] is None:
            row = {**row, **extract_prompt(row)}
        where, prompt = row[ORIGIN], row["prompt"]
        head = prompt_ids(tokenizer, prompt, where)
        parts = []
        for name in ("chosen", "rejected"):
            if isinstance(prompt, list):
                ids = render_chat(tokenizer, prompt + row[name], f"{where}, `{name}`")
            else:
                ids = tokenizer(prompt + row[name])["input_ids"] + [tokenizer.eos_token_id]
            parts.append((name, ids, [i >= len(head) for i in range(len(ids))]))
        yield Sample(where, parts, limit is not None and keep_start and len(head) >= limit)


def _dpo_vision(rows, processor, experiment: Experiment, splits, split: str) -> Iterator[Sample]:
    """Pairs with images as TRL's DataCollatorForVisionPreference makes them in training
    (the prompt's pictures expanded to their tokens), one pair at a time and uncut. TRL
    drops no such pair: a max_length that cuts into the prompt's image tokens stops
    training (trainers/vision.py)."""
    from trl.data_utils import extract_prompt
    from trl.trainer.dpo_trainer import DataCollatorForVisionPreference

    from finetune.data.image_size import ImagesSized

    collate = ImagesSized(DataCollatorForVisionPreference(processor=processor), experiment)
    for row in rows:
        if row.get("prompt") is None:
            row = {**row, **extract_prompt(row)}
        batch = collate([{"prompt": row["prompt"], "chosen": row["chosen"],
                          "rejected": row["rejected"], "images": row.get("images") or []}])
        parts = []
        for i, name in enumerate(("chosen", "rejected")):
            kept = batch["attention_mask"][i].bool()
            parts.append((name, batch["input_ids"][i][kept].tolist(),
                          batch["completion_mask"][i][kept].bool().tolist()))
        yield Sample(row[ORIGIN], parts)


def _prompts(rows, tokenizer, experiment: Experiment, splits, split: str) -> Iterator[Sample]:
    for row in rows:
        ids = prompt_ids(tokenizer, row["prompt"], row[ORIGIN])
        yield Sample(row[ORIGIN], [("prompt", ids, [False] * len(ids))])


def _prompts_vision(rows, processor, experiment: Experiment, splits,
                    split: str) -> Iterator[Sample]:
    """Prompts with images as GRPOTrainer renders them to generate: each picture expanded
    to its image tokens."""
    from finetune.model.vision import chat_prompts

    for row in rows:
        ids = chat_prompts(processor, [row["prompt"]], [row.get("images") or []]
                           )["input_ids"][0].tolist()
        yield Sample(row[ORIGIN], [("prompt", ids, [False] * len(ids))])


def _classify(rows, tokenizer, experiment: Experiment, splits, split: str) -> Iterator[Sample]:
    for row in rows:
        ids = tokenizer(row["text"])["input_ids"]
        yield Sample(row[ORIGIN], [(f"label {row['label']}", ids, [False] * len(ids))])


def _kto(rows, tokenizer, experiment: Experiment, splits, split: str) -> Iterator[Sample]:
    """An unpaired row as KTOTrainer tokenizes it (EOS after a text completion); dropped
    where the prompt alone fills max_length, as KTOTrainer drops it."""
    limit = value(experiment, "max_length")
    eos = tokenizer.eos_token or ""
    for row in rows:
        where, prompt, completion = row[ORIGIN], row["prompt"], row["completion"]
        head = prompt_ids(tokenizer, prompt, where)
        if isinstance(prompt, list):
            ids = render_chat(tokenizer, prompt + completion, f"{where}, `completion`")
        else:
            ids = tokenizer(prompt + completion + ("" if completion.endswith(eos) else eos))[
                "input_ids"]
        name = "desirable" if row["label"] else "undesirable"
        yield Sample(where, [(name, ids, [i >= len(head) for i in range(len(ids))])],
                     limit is not None and len(head) >= limit)


def _kto_vision(rows, processor, experiment: Experiment, splits, split: str) -> Iterator[Sample]:
    """Unpaired rows with images as TRL's DataCollatorForVisionUnpairedPreference makes
    them in training (the prompt's pictures expanded to their tokens), one row at a time
    and uncut; dropped where the prompt alone fills max_length, as finetune drops it
    (methods/vision_lengths.py kept_unpaired)."""
    from trl.trainer.kto_trainer import DataCollatorForVisionUnpairedPreference

    from finetune.data.image_size import ImagesSized

    collate = ImagesSized(DataCollatorForVisionUnpairedPreference(processor, calculate_kl=False),
                          experiment)
    limit = value(experiment, "max_length")
    for row in rows:
        batch = collate([{key: row.get(key) for key in ("prompt", "completion", "label")} |
                         {"images": row.get("images") or []}])
        ids, trained = batch["input_ids"][0].tolist(), batch["completion_mask"][0].bool().tolist()
        name = "desirable" if row["label"] else "undesirable"
        prompt = trained.index(True) if True in trained else len(ids)
        yield Sample(row[ORIGIN], [(name, ids, trained)],
                     limit is not None and isinstance(row["prompt"], list) and prompt >= limit)


def _last_turn(rows, tokenizer, experiment: Experiment, splits, split: str) -> Iterator[Sample]:
    """gkd's conversations as TRL's GKD collator renders them: the last (assistant) turn
    trained, the turns before it the prompt, cut from its start where the row is longer
    than max_length."""
    for row in rows:
        where, messages = row[ORIGIN], row["messages"]
        ids = render_chat(tokenizer, messages, where)
        head = prompt_ids(tokenizer, messages[:-1], where)
        yield Sample(where, [("", ids, [i >= len(head) for i in range(len(ids))])])


def _distills_data(own) -> bool:
    """A distillation method (the teacher's section) on the data's own completions."""
    return "distill" in own.sections and not own.generates


def _view(experiment: Experiment):
    """How a method's rows are shown, from its record: a score head's pairs or labelled
    texts, a generating method's prompts, unpaired or paired preference rows, or sft's
    tokens."""
    own = record(experiment)
    if own.head == "score":
        return _classify if own.labels else _reward
    if own.generates:
        return _prompts
    if _distills_data(own):
        return _last_turn
    if "unpaired_preference" in own.formats:
        return _kto
    return _dpo if own.sequences == 2 else _sft




def _percentile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _limits(experiment: Experiment) -> tuple[str | None, int | None]:
    own = record(experiment)
    if own.max_length is None:
        return None, None
    return own.max_length, value(experiment, own.max_length.split(".")[-1]) \
        if own.max_length.startswith("training.") else experiment.classify.max_length


def _summary(samples: list[Sample], experiment: Experiment) -> list[str]:
    lengths = [s.length for s in samples]
    lines = [f"  token lengths: min {min(lengths)}, median {_percentile(lengths, 0.5)}, "
             f"p90 {_percentile(lengths, 0.9)}, p99 {_percentile(lengths, 0.99)}, "
             f"max {max(lengths)}"]
    setting, limit = _limits(experiment)
    if limit is not None:
        longer = sum(length > limit for length in lengths)
        dropped = sum(s.dropped for s in samples)
        what = "dropped, as RewardTrainer drops a longer pair" \
            if record(experiment).name == "reward" else \
            f"{longer - dropped} cut, {dropped} dropped by the method's preparation"
        lines.append(f"  {setting} {limit}: {longer} of {len(samples)} rows longer: {what}")
    elif setting is not None:
        lines.append(f"  {setting} null: no row is cut")
    return lines


def _head(rows, count: int):
    """The first `count` rows a stream (data.streaming) gives, as a dataset: the stream is
    endless (it starts over when the files end), so its length is never known."""
    from datasets import Dataset

    return Dataset.from_list(list(rows.take(count)), features=rows.features)


def report(experiment: Experiment, shown: int) -> list[str]:
    """The lines `finetune data` prints."""
    from finetune.model.tokenizer import load_processor, load_tokenizer
    from finetune.model.vision import is_vision_language

    vision = is_vision_language(experiment)  # its processor: tokenizer and images
    tokenizer = load_processor(experiment) if vision else load_tokenizer(experiment)
    splits = load_data(experiment)
    require_chat_template(splits, tokenizer, experiment)
    lines = [f"method {experiment.method}, data format {splits.format}; trained tokens "
             f"between {OPEN} and {CLOSE}"] + [f"note: {note}" for note in splits.notes]
    sample = _view(experiment)
    if vision:  # rows as the vision collators make them
        sample = {_sft: _sft_vision, _dpo: _dpo_vision, _kto: _kto_vision,
                  _prompts: _prompts_vision}.get(sample, sample)
    if sample in (_sft, _sft_vision):
        from finetune.methods.sft import trained_tokens

        said = trained_tokens(experiment, splits.format)
        lines += [f"note: {said}"] if said else []
    own = record(experiment)
    if own.generates or _distills_data(own):  # the prompts or conversations it prepares
        from finetune.methods import preparation

        splits = preparation(experiment)(splits, tokenizer, experiment)
    for split, rows in (("train", splits.train), ("eval", splits.eval)):
        if rows is None:
            continue
        streamed = not hasattr(rows, "__len__")
        if streamed:
            rows = _head(rows, max(STREAM_ROWS, shown))
        samples = list(in_processes(sample, rows, tokenizer, experiment, splits, split,
                                    processes(experiment, len(rows)))
                       if vision else sample(rows, tokenizer, experiment, splits, split))
        lines.append(f"data.{split}: streamed, its length unknown (read as training goes, "
                     f"from the start again when it ends); the first {len(samples)} rows "
                     "it reads:" if streamed else f"data.{split}: {len(samples)} rows")
        for s in samples[:shown] if split == "train" else ():
            lines.append(f"--- {s.where} ({s.length} tokens{', dropped' if s.dropped else ''})")
            for name, ids, trained in s.parts:
                lines.append(f"{name + ': ' if name else ''}{marked(tokenizer, ids, trained)}")
        lines += _summary(samples, experiment)
    return lines
