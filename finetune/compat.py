"""Where finetune relies on library internals: all of it here, as trl/_compat.py keeps TRL's.

Written for the versions in WRITTEN_FOR (constraints.txt pins them). Each function below
uses one private member, or works around one library behaviour, that no public API
covers in those versions; its docstring says what it relies on and where the library
sets it. Private methods finetune overrides stay overrides in their own classes, listed
in OVERRIDES with the exact parameters the library calls them with; private methods it
calls are in CALLED. tests/test_compat.py checks every entry against the installed
libraries (on a real tiny trainer where an attribute only exists there), so an upgrade
that moves one fails there, not in a run. After checking each entry against the new
sources, bump WRITTEN_FOR with constraints.txt.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

WRITTEN_FOR = {"transformers": "5.23.0", "trl": "1.16.0", "accelerate": "1.15.0",
               "peft": "0.21.2"}


@dataclass(frozen=True)
class Member:
    """A private method or attribute of a library class: `owner` is "module:Class"."""

    owner: str
    name: str
    parameters: tuple[str, ...] = ()  # methods: every parameter after self, in order
    users: str = ""  # ours: what overrides, calls or reads it


# Private attributes read or set below. The test finds each on a real tiny trainer, at the
# point finetune uses it (the loss window only exists while train() runs).
ATTRIBUTES = (
    Member("transformers:Trainer", "_tr_loss", users="loss_window, set_loss_window"),
    Member("transformers:Trainer", "_globalstep_last_logged",
           users="loss_window, set_loss_window"),
    Member("transformers:Trainer", "_signature_columns",
           users="signature_columns, set_signature_columns"),
    Member("trl:GRPOTrainer", "_step", users="grpo_generation, set_grpo_generation"),
    Member("trl:GRPOTrainer", "_buffered_inputs", users="grpo_generation, set_grpo_generation"),
    Member("trl:GRPOTrainer", "_metrics", users="grpo_generation, set_grpo_generation"),
    Member("trl:RLOOTrainer", "_step", users="grpo_generation, set_grpo_generation"),
    Member("trl:RLOOTrainer", "_buffered_inputs", users="grpo_generation, set_grpo_generation"),
    Member("trl:RLOOTrainer", "_metrics", users="grpo_generation, set_grpo_generation"),
    Member("trl:RewardTrainer", "_metrics", users="log_metric"),
    Member("trl:DPOTrainer", "_metrics", users="log_metric"),
    Member("transformers:PretrainedConfig", "_attn_implementation",
           users="attention_implementation"),
)

# Private methods called below, with the parameters passed to them by name.
CALLED = (
    Member("transformers:Trainer", "_get_dataloader",
           ("dataset", "description", "batch_size", "sampler_fn", "is_training"),
           users="dataloader (PPOTrainer.get_train_dataloader)"),
    Member("transformers:Trainer", "_prepare_inputs", ("inputs",),
           users="prepared_inputs (ClassifyTrainer.prediction_step)"),
)

# Private methods finetune's classes override: the library calls them with exactly these
# parameters. `users` names each overriding class (module:Class).
OVERRIDES = (
    Member("transformers:Trainer", "_set_signature_columns_if_needed",
           users="finetune.trainers.classify:ClassifyTrainer"),
    Member("trl:RewardTrainer", "_set_signature_columns_if_needed",
           users="finetune.trainers.weighted:WeightedRewardTrainer"),
    Member("trl:DPOTrainer", "_set_signature_columns_if_needed",
           users="finetune.trainers.weighted:WeightedDPOTrainer"),
    Member("trl:SFTTrainer", "_set_signature_columns_if_needed",
           users="finetune.trainers.weighted:WeightedVisionSFTTrainer "
                 "finetune.trainers.vision:VisionSFTTrainer"),
    Member("transformers:Trainer", "_get_num_items_in_batch", ("batch_samples", "device"),
           users="finetune.trainers.weighted:WeightedSFTTrainer "
                 "finetune.trainers.weighted:WeightedVisionSFTTrainer "
                 "finetune.trainers.weighted:WeightedRewardTrainer "
                 "finetune.trainers.weighted:WeightedDPOTrainer "
                 "finetune.trainers.classify:ClassifyTrainer"),
    Member("transformers:Trainer", "_prepare_inputs", ("inputs",),
           users="finetune.trainers.ppo:PPOTrainer"),
    Member("transformers:Trainer", "_save", ("output_dir", "state_dict"),
           users="finetune.trainers.ppo:PPOTrainer"),
    Member("transformers:Trainer", "_load_from_checkpoint", ("resume_from_checkpoint", "model"),
           users="finetune.trainers.ppo:PPOTrainer finetune.trainers.vision:VisionSFTTrainer "
                 "finetune.trainers.vision:VisionDPOTrainer "
                 "finetune.trainers.vision:VisionKTOTrainer "
                 "finetune.methods.grpo:ResumableVisionGRPOTrainer "
                 "finetune.methods.rloo:ResumableVisionRLOOTrainer "
                 "finetune.methods.distill:ResumableVisionDistillationTrainer"),
    Member("transformers:Trainer", "_load_best_model", users="finetune.trainers.ppo:PPOTrainer"),
    # methods/online.py EpochOrder: the order of an epoch from seed + epoch.
    Member("trl:DistillationTrainer", "_get_train_sampler", ("dataset",),
           users="finetune.methods.distill:ResumableDistillationTrainer "
                 "finetune.methods.distill:ResumableVisionDistillationTrainer"),
    Member("trl:GRPOTrainer", "_get_train_sampler", ("dataset",),
           users="finetune.methods.grpo:ResumableGRPOTrainer "
                 "finetune.methods.grpo:ResumableVisionGRPOTrainer"),
    Member("trl:RLOOTrainer", "_get_train_sampler", ("dataset",),
           users="finetune.methods.rloo:ResumableRLOOTrainer "
                 "finetune.methods.rloo:ResumableVisionRLOOTrainer"),
)


# ---- the Trainer's logging window (callbacks.LossWindow) ----

def loss_window(trainer) -> tuple[Any, int]:
    """The loss summed on device since the last log, and that log's step. Trainer keeps
    them in _tr_loss and _globalstep_last_logged, (re)set by _inner_training_loop just
    before on_train_begin; _maybe_log_save_evaluate logs their mean. No callback sees them."""
    return trainer._tr_loss, trainer._globalstep_last_logged


def set_loss_window(trainer, loss_sum, since: int) -> None:
    """Reopen a saved window; from on_train_begin on, the Trainer keeps adding to it."""
    trainer._tr_loss = loss_sum.to(trainer._tr_loss.device)
    trainer._globalstep_last_logged = since


# ---- GRPO's and RLOO's generation window (methods/online.py) ----

@dataclass
class GenerationWindow:
    step: int  # GRPOTrainer._step: micro-steps taken; a generation starts at multiples
    buffer: list | None  # _buffered_inputs: the window's generated batches, None: generate
    metrics: dict[str, list] | None  # _metrics["train"]: values averaged at the next log


def grpo_generation(trainer) -> GenerationWindow:
    """GRPOTrainer (and RLOOTrainer, alike) sets _step, _buffered_inputs and _metrics in
    __init__; _prepare_inputs generates when _step % (steps_per_generation x
    num_iterations) == 0 or the buffer is None, training_step counts _step, log()
    averages and clears _metrics[mode]."""
    return GenerationWindow(trainer._step, trainer._buffered_inputs,
                            dict(trainer._metrics["train"]))


def set_grpo_generation(trainer, window: GenerationWindow) -> None:
    """metrics None leaves the open metrics as they are."""
    from collections import defaultdict

    trainer._step = window.step
    trainer._buffered_inputs = window.buffer
    if window.metrics is not None:
        trainer._metrics["train"] = defaultdict(list, window.metrics)


# ---- TRL trainers' logged metrics (trainers/weighted.py) ----

def log_metric(trainer, mode: str, name: str, value: float) -> None:
    """Reward-, DPO- and GRPOTrainer average what is in _metrics[mode][name] (set in
    __init__) at their next log() and clear it; our weighted losses report as theirs do."""
    trainer._metrics[mode][name].append(value)


# ---- which dataset columns reach the collator (trainers/weighted.py, classify.py) ----

def signature_columns(trainer) -> list[str] | None:
    """Trainer._signature_columns: the columns _remove_unused_columns keeps (None until
    _set_signature_columns_if_needed fills it; TRL's trainers fill it with their own)."""
    return trainer._signature_columns


def set_signature_columns(trainer, columns: list[str]) -> None:
    trainer._signature_columns = list(columns)


# ---- Trainer helpers with no public equivalent (trainers/ppo.py, classify.py) ----

def dataloader(trainer, dataset, description: str, batch_size: int, sampler_fn,
               is_training: bool):
    """Trainer._get_dataloader: the DataLoader get_train_dataloader builds (collator,
    worker settings and seeding, accelerator.prepare), for a batch size of our choosing."""
    return trainer._get_dataloader(dataset=dataset, description=description,
                                   batch_size=batch_size, sampler_fn=sampler_fn,
                                   is_training=is_training)


def prepared_inputs(trainer, inputs: dict[str, Any]) -> dict[str, Any]:
    """Trainer._prepare_inputs: a batch moved to the device (and cast under DeepSpeed), as
    Trainer.prediction_step does before its forward."""
    return trainer._prepare_inputs(inputs)


def attention_implementation(model) -> str | None:
    """The attention a built model runs (auto resolved): config._attn_implementation, a
    property with no public reader (set_attn_implementation only writes it)."""
    return getattr(getattr(model, "config", None), "_attn_implementation", None)


# ---- library behaviours worked around while a trainer is built ----

@contextmanager
def sft_trainer_on_our_tokens(args):
    """SFTTrainer.__init__ (trl 1.16) refuses assistant_only_loss unless its dataset's
    first row is conversational, and padding_free without packing when max_length is
    set (it would not enforce it). finetune hands it rows it tokenized itself, masked
    and truncated (data/sft_tokens.py), so both are off while it is built and restored
    after, for the record (training_args.json)."""
    saved = args.assistant_only_loss, args.max_length
    args.assistant_only_loss, args.max_length = False, None
    try:
        yield
    finally:
        args.assistant_only_loss, args.max_length = saved


@contextmanager
def grpo_reference_from(config, path: str):
    """Without PEFT and with beta > 0, GRPOTrainer.__init__ (and RLOOTrainer's, trl 1.16)
    builds the reference model with create_model_from_path(get_config_model_id(model.config)), which
    reads config._name_or_path: what the public config.name_or_path sets. Point it at
    `path` while the trainer is built."""
    original = config.name_or_path
    config.name_or_path = path
    try:
        yield
    finally:
        config.name_or_path = original
