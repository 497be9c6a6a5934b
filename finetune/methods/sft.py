"""Supervised fine-tuning through TRL's SFTTrainer (messages, prompt/completion or text).

finetune tokenizes the rows itself (data/sft_tokens.py, run once by data/prepare.py and
cached), with TRL's meaning of assistant_only_loss, completion_only_loss, max_length,
truncation_mode and packing, and hands SFTTrainer the tokenized rows. With per-sample
weights (data.weight_column) or per-turn weights (`weight` on assistant messages) the
rows carry token weights and WeightedSFTTrainer's loss is the weighted mean over the
global batch."""

from __future__ import annotations

from trl import SFTTrainer

from finetune import compat
from finetune.data import sft_tokens
from finetune.data.load import Splits
from finetune.data.parallel import processes
from finetune.config import stateful
from finetune.config.schema import Experiment
from finetune.config.derived.effective import value as effective_value
from finetune.errors import ConfigError
from finetune.methods import Job, sft_vision
from finetune.model.vision import is_processor


def _value(experiment: Experiment):
    """key -> the training argument the run will have (config/derived/effective.py)."""
    return lambda key: effective_value(experiment, key)


def assistant_only(experiment: Experiment, fmt: str) -> bool:
    """training.assistant_only_loss as the experiment gives it; unset, true for
    conversations (messages): a chat model learns the assistant's turns, not the user's.
    TRL's own default (false) trains on every turn, the loss-mask mistake most reported in
    the field; text rows train on everything."""
    given = experiment.training.get("assistant_only_loss")
    return bool(given) if given is not None else fmt == "messages"


def trained_tokens(experiment: Experiment, fmt: str) -> str | None:
    """What the start summary and `finetune data` say a conversation trains on."""
    if fmt != "messages":
        return None
    given = experiment.training.get("assistant_only_loss")
    if assistant_only(experiment, fmt):
        return ("trained tokens: the assistant turns only (training.assistant_only_loss"
                + (", the default for conversations; false trains every turn)" if given is None
                   else ")"))
    return "trained tokens: every turn, the user's too (training.assistant_only_loss: false)"


def _masking(splits: Splits, experiment: Experiment) -> sft_tokens.Masking:
    value = _value(experiment)
    weighted = experiment.data.weight_column is not None or \
        sft_tokens.uses_token_weights(splits.train, splits.format)
    # What depends on the rows; the settings alone were checked by config/rules/.
    problems = []
    if experiment.training.get("assistant_only_loss") and splits.format == "text":
        problems.append("training.assistant_only_loss: needs conversational data "
                        "(messages, or prompt/completion as message lists); this data is text")
    packed = [name for name in ("packing", "padding_free") if value(name)]
    if weighted and packed:
        problems.append(f"training.{packed[0]}: not supported with loss weights "
                        "(data.weight_column or `weight` on messages)")
    if weighted and experiment.distributed.sequence_parallel > 1:
        problems.append("distributed.sequence_parallel: not supported with loss weights "
                        "(`weight` on messages): the Trainer's sequence-parallel loss is the "
                        "model's own mean over tokens")
    if problems:
        raise ConfigError(problems)
    return sft_tokens.Masking(
        assistant_only=assistant_only(experiment, splits.format),
        completion_only=value("completion_only_loss") is not False,
        max_length=value("max_length"), keep_end=value("truncation_mode") == "keep_end",
        weighted=weighted)


def _packed(dataset, experiment: Experiment):
    from trl import pack_dataset

    value = _value(experiment)
    if value("shuffle_dataset"):  # before packing, as TRL does: packs mix the whole data
        dataset = dataset.shuffle(seed=value("seed"))
    return pack_dataset(dataset, value("max_length"), value("packing_strategy"))


def _streamed(splits: Splits, tokenizer, experiment: Experiment,
              masking: sft_tokens.Masking) -> Splits:
    """data.streaming: the train stream tokenized and packed as it is read. TRL's
    pack_dataset maps a stream in batches of 1000 rows, so the packs are made within each
    such window (wrapped: a short last block per window), never across the whole data."""
    from trl import pack_dataset

    value = _value(experiment)
    stream = sft_tokens.tokenize_stream(splits.train, tokenizer, masking)
    out = splits.tokenized(lambda rows, split: stream if split == "train" else
                           sft_tokens.tokenize(rows, tokenizer, splits.format, masking, split,
                                               processes(experiment, len(rows))))
    out.train = pack_dataset(stream, value("max_length"), value("packing_strategy"))
    if out.eval is not None and value("eval_packing") is not False:
        out.eval = _packed(out.eval, experiment)
    return out


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    """Tokenized (and packed, with training.packing) train and eval rows; a
    vision-language model's rows go to TRL's vision path untokenized (sft_vision.py)."""
    if is_processor(tokenizer):
        return sft_vision.prepare(splits, tokenizer, experiment,
                                  trained_tokens(experiment, splits.format),
                                  assistant_only(experiment, splits.format))
    sft_vision.refuse_images(splits, experiment)
    masking = _masking(splits, experiment)
    said = trained_tokens(experiment, splits.format)
    if said and said not in splits.notes:  # kept with the prepared data, said at each start
        splits.notes.append(said)
    if experiment.data.streaming:
        return _streamed(splits, tokenizer, experiment, masking)
    out = splits.tokenized(
        lambda rows, split: sft_tokens.tokenize(rows, tokenizer, splits.format, masking, split,
                                                processes(experiment, len(rows))))
    value = _value(experiment)
    if value("packing"):
        out.train = _packed(out.train, experiment)
        if out.eval is not None and value("eval_packing") is not False:
            out.eval = _packed(out.eval, experiment)
    elif value("shuffle_dataset"):
        out.train = out.train.shuffle(seed=value("seed"))
    return out


def _padded_if_stateful(job: Job) -> None:
    """A model with a recurrent state trains on padded rows (config/stateful.py): a hub
    model's type is known here, once loaded (a local one's at validate)."""
    if not getattr(job.model, "_is_stateful", False):
        return
    for key in ("packing", "padding_free"):
        if job.experiment.training.get(key):
            raise ConfigError([f"training.{key}: "
                               f"{stateful.refusal(job.model.config.model_type)}"])
    job.args.padding_free = False  # our speed default only


def build_trainer(job: Job) -> SFTTrainer:
    if is_processor(job.tokenizer):
        return sft_vision.build_trainer(job, assistant_only(job.experiment, job.data.format))
    _padded_if_stateful(job)
    args = job.args
    args.dataset_kwargs = {**(args.dataset_kwargs or {}), "skip_prepare_dataset": True}
    kwargs = dict(model=job.model, args=args, train_dataset=job.data.train,
                  eval_dataset=job.data.eval, processing_class=job.tokenizer,
                  callbacks=job.callbacks)
    if job.experiment.data.streaming:
        # Every process reads the stream and keeps its own batches of each global batch
        # (accelerate's IterableDatasetShard). Dispatching (rank 0 reads, the default for
        # an iterable dataset) concatenates the processes' batches, which packed batches
        # of different lengths cannot be.
        args.accelerator_config.dispatch_batches = False
    if "token_weights" in (job.data.train.column_names or ()):
        from finetune.trainers.weighted import WeightedSFTTrainer, pad_batch

        args.remove_unused_columns = False  # TRL must keep the column it does not know
        args.padding_free = False  # our default only: prepare() refused it if it was set
        pad_id = job.tokenizer.pad_token_id
        with compat.sft_trainer_on_our_tokens(args):
            return WeightedSFTTrainer(**kwargs, data_collator=lambda rows: pad_batch(rows, pad_id))
    if job.experiment.distributed.sequence_parallel > 1:
        from functools import partial

        from finetune.trainers.sequence import SequenceParallelSFTTrainer

        # The trainer skips the trained batches itself on resume (trainers/sequence.py).
        trainer = partial(SequenceParallelSFTTrainer, ignores_data_skip=args.ignore_data_skip)
        args.ignore_data_skip = True
    else:
        trainer = SFTTrainer
    with compat.sft_trainer_on_our_tokens(args):  # prepare() applied both
        return trainer(**kwargs)
