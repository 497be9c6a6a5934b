"""sft of a vision-language model on rows with images (data/images.py), through TRL's own
vision path: SFTTrainer with the model's processor as processing_class collates each
batch from the raw rows (DataCollatorForVisionLanguageModeling: the chat template renders
the messages with the image token, the processor expands it and turns the images into
pixel values). Nothing is tokenized ahead: image processing per batch is TRL's design,
and the prepared-data cache keeps the checked rows (messages and absolute image paths).

What trains: the assistant turns by default, as for text conversations (sft.py
assistant_only): TRL masks every token outside the template's {% generation %} markers
(or its training version of the template), the prompt and so every image token; a
template with neither has its turns found by prefixes (vision_turns.py).
Prompt/completion rows train their completion (training.completion_only_loss, TRL's
default): conversational ones through TRL's collator, plain ones through
sft_plain_vision.PlainPictures. Image tokens never train, every turn trained or not
(ImageTokensUntrained: TRL's collator leaves them in the labels then). With data.weight_column, each row's trained tokens weigh its weight (and
a `weight` on an assistant message its turn's), and the loss is the weighted mean over
the global batch as for text (trainers/weighted.py RowWeightsOnTokens)."""

from __future__ import annotations

from trl import SFTTrainer

from finetune.config.derived.effective import value as effective_value
from finetune.config.rules.vision import PREFIX_TRAINED
from finetune.config.schema import Experiment
from finetune.data.image_size import ImagesSized, fitter
from finetune.data.images import IMAGES
from finetune.data.load import ORIGIN, Splits
from finetune.data.parallel import processes
from finetune.data.rows import PREFIX_LM_ROWS, TURN_WEIGHTS_WITH_IMAGES, WEIGHT
from finetune.errors import ConfigError, DataError
from finetune.methods import Job, vision_lengths
from finetune.methods.vision_turns import SPANS, TurnsTrained, turns_of
from finetune.methods.sft_plain_vision import PlainPictures
from finetune.model.vision import image_token_ids, prefix_lm
from finetune.trainers.vision import VisionSFTTrainer
from finetune.trainers.weighted import RowWeightsOnTokens, WeightedVisionSFTTrainer

# format -> the columns its collator reads; every other one is dropped before it.
FORMATS = {"messages": ("messages", IMAGES), "prompt_completion": ("prompt", "completion", IMAGES)}


def refuse_images(splits: Splits, experiment: Experiment) -> None:
    """Rows with images reaching a text model's preparation (a hub model validate could
    not read): one line, not a template error on the first image part."""
    if IMAGES in (splits.train.column_names or ()):
        raise DataError(f"data.train: the rows have images, and model.name_or_path "
                        f"{experiment.model.name_or_path} is not a vision-language model")


def turn_weights(splits: Splits) -> bool:
    """Does an assistant message of the training rows carry its own `weight`?"""
    return "messages" in (splits.train.column_names or ()) and any(
        m.get("weight") is not None for row in splits.train["messages"] for m in row)


def _problems(splits: Splits, processor, experiment: Experiment) -> list[str]:
    training, problems = experiment.training, []
    if splits.format not in FORMATS:
        problems.append("data.train: a vision-language model trains on conversations "
                        "(`messages`, with image parts and `images` or text only) or on "
                        "`prompt`/`completion` rows (with `images` or without); other rows "
                        f"(here format {splits.format}) are not supported yet")
    elif prefix_lm(processor) and (splits.format == "messages" or not all(
            isinstance(p, str) for p in splits.train["prompt"])):
        problems.append(PREFIX_LM_ROWS)
    elif prefix_lm(processor) and training.get("completion_only_loss") is False:
        problems.append(f"training.completion_only_loss: {PREFIX_TRAINED}")
    elif splits.format == "prompt_completion" and len(
            {isinstance(p, str) for p in splits.train["prompt"]}) > 1:
        problems.append("data.train: mixes plain-text and conversational prompts; one "
                        "file's prompt/completion rows are all text or all message lists")
    for key in ("packing", "padding_free"):
        if training.get(key):
            problems.append(f"training.{key}: not supported for rows with images (TRL "
                            "collates them padded, one row per sequence)")
    if splits.format == "messages" and training.get("assistant_only_loss") is False and \
            turn_weights(splits):
        problems.append(TURN_WEIGHTS_WITH_IMAGES)  # validate says it too (data/scan.py)
    if training.get("truncation_mode") == "keep_end":
        problems.append("training.truncation_mode keep_end: would cut the image tokens "
                        "off the prompt; rows with images are cut at the end (keep_start)")
    return problems


def prepare(splits: Splits, processor, experiment: Experiment, said: str | None,
            assistant_only: bool) -> Splits:
    """The checked rows as they are, with the columns the collator reads (and ORIGIN,
    which data/prepare.py removes), less those training.max_length would cut inside their
    image tokens or leave untrained (vision_lengths.py). said: what trains, for the start
    summary."""
    problems = _problems(splits, processor, experiment)
    if problems:
        raise ConfigError(problems)
    if said and said not in splits.notes:
        splits.notes.append(said)
    max_length, fit = effective_value(experiment, "max_length"), fitter(experiment)
    completion_only = effective_value(experiment, "completion_only_loss") is not False
    turns = turns_of(processor)

    def keep(rows, split):
        if IMAGES not in rows.column_names:  # text-only rows: no pictures to collate
            rows = rows.add_column(IMAGES, [[] for _ in range(len(rows))])
        if splits.format == "messages":
            rows = vision_lengths.kept(rows, split, processor, max_length, assistant_only,
                                       fit, splits.notes, turns,
                                       processes(experiment, len(rows)))
        else:
            rows = vision_lengths.kept_completions(rows, split, processor, max_length,
                                                   completion_only, fit, splits.notes,
                                                   processes(experiment, len(rows)))
        return rows.select_columns([c for c in (*FORMATS[splits.format], SPANS, WEIGHT, ORIGIN)
                                    if c in rows.column_names])

    return splits.tokenized(keep)


def build_trainer(job: Job, assistant_only: bool) -> SFTTrainer:
    """assistant_only: finetune's choice (sft.py; the assistant turns, unless
    training.assistant_only_loss is false), which TRL's collator applies here."""
    args, training = job.args, job.experiment.training
    completions = "completion" in (job.data.train.column_names or ())
    plain = completions and isinstance(job.data.train[0]["prompt"], str)
    by_prefixes = SPANS in (job.data.train.column_names or ())  # vision_turns.py
    args.assistant_only_loss = assistant_only and not completions and not by_prefixes
    # TRL's vision collator refuses completion_only_loss for messages
    completion_only = effective_value(job.experiment, "completion_only_loss") is not False
    args.completion_only_loss = completion_only if completions else None
    if "padding_free" not in training:
        args.padding_free = False  # our speed default only; refused above when set
    weighted = WEIGHT in (job.data.train.column_names or ()) or turn_weights(job.data)
    trainer_class = WeightedVisionSFTTrainer if weighted else VisionSFTTrainer
    trainer = trainer_class(model=job.model, args=args, train_dataset=job.data.train,
                            eval_dataset=job.data.eval, processing_class=job.tokenizer,
                            callbacks=job.callbacks)
    if plain:  # TRL's collator cannot lay them out (sft_plain_vision.py)
        trainer.data_collator = PlainPictures(job.tokenizer, args.max_length, completion_only)
    collate = ImagesSized(trainer.data_collator, job.experiment)  # vision.max/min_pixels
    if by_prefixes:
        collate = TurnsTrained(collate)
    trainer.data_collator = ImageTokensUntrained(ImageTokensKept(collate, args.max_length),
                                                 job.tokenizer)
    if weighted:  # data.weight_column, turn weights: the loss weighted (trainers/weighted.py)
        trainer.data_collator = RowWeightsOnTokens(trainer.data_collator)
    return trainer


class ImageTokensKept:
    """TRL's vision collator, whose processor refuses a row that training.max_length cuts
    inside its image tokens (a ValueError naming `truncation`): that as one line saying
    which setting to raise, not a traceback from the data loader."""

    def __init__(self, collate, max_length: int | None):
        self.collate, self.max_length = collate, max_length

    def __call__(self, rows):
        try:
            return self.collate(rows)
        except ValueError as exc:
            if "token count" not in str(exc):
                raise
            raise DataError(f"training.max_length {self.max_length} cuts a row of this batch "
                            "inside its image tokens: raise it (`finetune data` shows every "
                            "row's length with its image tokens)") from None


class ImageTokensUntrained:
    """A vision collator's batch with no image token in its labels (model/vision.py
    image_token_ids): with every turn trained (training.assistant_only_loss false) TRL's
    collator would train the model to predict the placeholders it is given."""

    def __init__(self, collate, processor):
        import torch

        self.collate, self.ids = collate, torch.tensor(image_token_ids(processor))

    def __call__(self, rows):
        import torch

        batch = self.collate(rows)
        batch["labels"][torch.isin(batch["input_ids"], self.ids)] = -100
        return batch
