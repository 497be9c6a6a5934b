"""Rows with images against training.max_length, while the data are prepared: each row
rendered as TRL's vision collator renders it (the processor's chat template, every image
expanded to its tokens, the pictures fitted to vision.max_pixels), untruncated. A row
whose image tokens reach past max_length would be cut inside them (the processor refuses
such a batch), and one whose trained tokens all lie past it would train nothing: both are
dropped, counted in the start summary, as text rows that train nothing after truncation
are (data/sft_tokens.py). None left is an error naming the setting. Preference pairs
(dpo) are measured by their prompt, which holds the pictures (kept_pairs); kto's unpaired
rows by their prompt too, with the generation prompt that comes before the completion
(kept_unpaired).

grpo's and rloo's prompts (kept_prompts) have no max_length: TRL 1.16's GRPOTrainer and
RLOOTrainer generate from each prompt whole (no max_prompt_length, nothing truncated, so
nothing cut inside its image tokens), and a prompt whose tokens, with the completion
budget after them, exceed the model's context would run it past its positions. Such
prompts are dropped and counted the same way: how many image tokens a picture becomes is
the processor's (Qwen2-VL's grow with the picture), not something the rows show. Text
prompts stay refused naming the row (data/prompts.py): their length is the text as
written."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from datasets import Dataset

from finetune.data.images import IMAGES
from finetune.data.load import ORIGIN
from finetune.errors import DataError
from finetune.methods.vision_turns import SPANS, Turns, rendered_ids, spans

SHOWN = "(`finetune data` shows every row's length with its image tokens)"
# What to change when no row fits: a hub checkpoint's processor may make thousands of
# tokens of a photo (Qwen2-VL's, up to 12.8 megapixels), which vision.max_pixels caps.
RAISE = ("raise it, or give vision.max_pixels (fewer image tokens where they grow with the "
         "picture: Qwen2-VL's and Qwen3-VL's, SmolVLM's tiles)")


@dataclass(frozen=True)
class Measured:
    length: int                 # tokens, the images' expanded
    image_end: int              # one past the last image token or marker (0: no image)
    first_trained: int | None   # the first trained token (None: none)
    spans: tuple = ()           # the assistant turns' [start, end), found by_prefixes


def measure(processor, messages: list[dict], images: list, assistant_only: bool,
            fit=list, turns: Turns = Turns(), where: str = "") -> Measured:
    """The row as it trains; where turns.by_prefixes, with its assistant turns' spans
    (vision_turns.py)."""
    from finetune.model.vision import image_token_ids, with_images

    rendered = with_images(messages, fit(images or []))
    marked = assistant_only and not turns.by_prefixes
    out = rendered_ids(processor, rendered, template=turns.template, assistant_mask=marked)
    ids = list(out["input_ids"][0])
    found = spans(processor, rendered, ids, where) if assistant_only and turns.by_prefixes \
        else []
    if marked:
        mask = list(out["assistant_masks"][0])
    elif found:
        mask = [any(start <= i < end for start, end in found) for i in range(len(ids))]
    else:
        mask = [not assistant_only] * len(ids)
    images = set(image_token_ids(processor))  # never trained (sft_vision.ImageTokensUntrained)
    ends = [i + 1 for i, t in enumerate(ids) if t in images]  # end markers included
    trained = [keep and t not in images for keep, t in zip(mask, ids)]
    first = next((i for i, keep in enumerate(trained) if keep), None)
    return Measured(len(ids), max(ends, default=0), first, tuple(found))


def fits(measured: Measured, max_length: int | None) -> bool:
    if max_length is None:
        return measured.first_trained is not None
    return measured.image_end <= max_length and measured.first_trained is not None \
        and measured.first_trained < max_length


def kept(rows: Dataset, split: str, processor, max_length: int | None, assistant_only: bool,
         fit, notes: list[str], turns: Turns = Turns(), num_proc: int | None = None) -> Dataset:
    """The rows that fit; a note counting the others; a DataError when none does. With
    turns.by_prefixes, each row's assistant spans in a SPANS column (vision_turns.py).
    num_proc: processes that measure (data/parallel.py)."""
    def one(row):
        m = measure(processor, row["messages"], row[IMAGES], assistant_only, fit, turns,
                    row[ORIGIN])
        return {"keep": fits(m, max_length), "spans": [list(span) for span in m.spans]}

    measured = _each(rows, one, num_proc)
    if assistant_only and turns.by_prefixes:
        rows = rows.add_column(SPANS, measured["spans"])
    return _selected(rows, measured["keep"], notes, f"data.{split}: no row fits "
                     f"training.max_length {max_length} with its image tokens and a trained "
                     f"token {SHOWN}: {RAISE}",
                     f"data.{split}: {{}} row(s) dropped: training.max_length {max_length} "
                     "would cut their image tokens or leave no trained token")


def kept_completions(rows: Dataset, split: str, processor, max_length: int | None,
                     completion_only: bool, fit, notes: list[str],
                     num_proc: int | None = None) -> Dataset:
    """kept, for prompt/completion rows: a plain one laid out as
    sft_plain_vision.PlainPictures collates it, a conversational one as TRL's collator
    renders it (the prompt with the generation prompt, then the completion's turns), its
    first trained token where the completion starts (every token with
    training.completion_only_loss false)."""
    def one(row):
        if isinstance(row["prompt"], str):
            measured = _measure_plain(processor, row, row[ORIGIN], completion_only, fit)
        else:
            whole = measure(processor, row["prompt"] + row["completion"], row[IMAGES], False,
                            fit)
            start = _prompt_length(processor, row["prompt"], row[IMAGES], fit)
            measured = Measured(whole.length, whole.image_end, start if completion_only else 0)
        return {"keep": fits(measured, max_length)}

    return _selected(rows, _each(rows, one, num_proc)["keep"], notes,
                     f"data.{split}: no row fits training.max_length "
                     f"{max_length} with its image tokens and a completion token {SHOWN}: "
                     f"{RAISE}",
                     f"data.{split}: {{}} row(s) dropped: training.max_length {max_length} "
                     "would cut their image tokens or leave no completion token")


def _each(rows: Dataset, one: Callable[[dict], dict], num_proc: int | None) -> dict[str, list]:
    """one(row) for every row, column by column: here, or in num_proc processes
    (datasets' map keeps the order; a photo through a hub processor takes tens of ms,
    and a dataset holds hundreds of thousands). Not cached by datasets: a picture can
    change under its path (finetune's own cache stamps them: data/picture_stamps.py)."""
    if num_proc is None:
        out = [one(row) for row in rows]
        return {key: [o[key] for o in out] for key in (out[0] if out else ("keep", "spans"))}
    done = rows.map(one, num_proc=num_proc, remove_columns=rows.column_names,
                    load_from_cache_file=False, keep_in_memory=True,
                    desc="measuring rows with images")
    return {key: done[key] for key in done.column_names}


def _measure_plain(processor, row: dict, where: str, completion_only: bool, fit) -> Measured:
    """A plain row's tokens as sft_plain_vision.PlainPictures lays them out."""
    from finetune.methods.sft_plain_vision import completion_ids
    from finetune.model.vision import encoded_prompt, image_token_ids

    ids = encoded_prompt(processor, row["prompt"], row[IMAGES], where, fit)[
        "input_ids"][0].tolist()
    images = set(image_token_ids(processor))
    image_end = max((i + 1 for i, t in enumerate(ids) if t in images), default=0)
    length = len(ids) + len(completion_ids(processor.tokenizer, row["completion"]))
    return Measured(length, image_end, len(ids) if completion_only else 0)


def _prompt_length(processor, prompt: list[dict], images: list, fit) -> int:
    from finetune.model.vision import chat_prompts

    return chat_prompts(processor, [prompt], [images or []], fit)["input_ids"].shape[1]


def kept_pairs(rows: Dataset, split: str, processor, max_length: int | None, fit,
               notes: list[str], num_proc: int | None = None) -> Dataset:
    """The pairs whose prompt's image tokens fit max_length (a pair without pictures
    always does); a note counting the others; a DataError when none does."""
    if max_length is None:
        return rows

    def one(row):
        return {"keep": not row[IMAGES] or measure(processor, row["prompt"], row[IMAGES],
                                                   False, fit).image_end <= max_length}

    return _selected(rows, _each(rows, one, num_proc)["keep"], notes,
                     f"data.{split}: no pair's prompt fits "
                     f"training.max_length {max_length} with its image tokens {SHOWN}: "
                     f"{RAISE}",
                     f"data.{split}: {{}} pair(s) dropped: training.max_length {max_length} "
                     "would cut their prompt's image tokens")


def kept_unpaired(rows: Dataset, split: str, processor, max_length: int | None, fit,
                  notes: list[str], num_proc: int | None = None) -> Dataset:
    """kto's rows whose prompt (rendered with its pictures and the generation prompt, as
    TRL's unpaired vision collator renders it before the completion) is shorter than
    max_length: its image tokens whole and a completion token left, as KTOTrainer's text
    path drops a row whose prompt fills max_length. A row with a text prompt has no
    pictures and is kept. A note counting the others; a DataError when none is left."""
    if max_length is None:
        return rows
    from finetune.model.vision import chat_prompts

    def one(row):
        return {"keep": not isinstance(row["prompt"], list) or chat_prompts(
            processor, [row["prompt"]], [row[IMAGES] or []], fit)["input_ids"].shape[1]
            < max_length}

    return _selected(rows, _each(rows, one, num_proc)["keep"], notes,
                     f"data.{split}: no row's prompt fits "
                     f"training.max_length {max_length} with its image tokens and a "
                     f"completion token {SHOWN}: {RAISE}",
                     f"data.{split}: {{}} row(s) dropped: training.max_length {max_length} "
                     "would cut their prompt's image tokens or leave no completion token")


def kept_prompts(rows: Dataset, split: str, processor, limit: int | None, setting: str,
                 budget: int, notes: list[str]) -> Dataset:
    """grpo's or rloo's prompts whose tokens (each rendered with its pictures and the
    generation prompt, as GRPOTrainer and RLOOTrainer render it to generate) leave
    `budget` tokens of the model's context for the completion (limit: the context less the
    budget; None: the context is unknown, all kept); a note counting the others; a
    DataError when none does. A prompt that is not a list of messages is a DataError
    naming its row."""
    from finetune.model.vision import chat_prompts

    images = rows[IMAGES] if IMAGES in rows.column_names else [None] * len(rows)
    keep = []
    for prompt, pictures, where in zip(rows["prompt"], images, rows[ORIGIN]):
        if not isinstance(prompt, list):
            raise DataError(f"{where}: a vision-language model generates from "
                            "conversational prompts (`prompt` a list of messages)")
        count = chat_prompts(processor, [prompt], [pictures or []])["input_ids"].shape[1]
        keep.append(limit is None or count <= limit)
    context = f"the model's context of {(limit or 0) + budget} tokens " \
              "(max_position_embeddings)"
    return _selected(rows, keep, notes, f"data.{split}: no prompt fits {context} with its "
                     f"image tokens and {setting} {budget} {SHOWN}: lower {setting}",
                     f"data.{split}: {{}} prompt(s) dropped: with their image tokens and "
                     f"{setting} {budget} they exceed {context}")


def _selected(rows: Dataset, keep: list[bool], notes: list[str], none_fits: str,
              dropped_said: str) -> Dataset:
    dropped = keep.count(False)
    if dropped == len(keep) and keep:
        raise DataError(none_fits)
    if dropped:
        notes.append(dropped_said.format(f"{dropped} of {len(keep)}"))
        rows = rows.select([i for i, k in enumerate(keep) if k])
    return rows
