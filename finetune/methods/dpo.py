"""Direct preference optimisation through TRL's DPOTrainer.

The reference model is passed explicitly: under LoRA TRL keeps a frozen copy of the
starting adapter; otherwise we hand it a frozen copy of the starting policy (or the
model named in dpo.ref_model). Left to itself TRL would reload the reference from
model.config.name_or_path, which is empty for a freshly initialised model.
"""

from trl import DPOTrainer

from finetune.data.load import Splits
from finetune.config.schema import Experiment
from finetune.config.derived.effective import value as effective_value
from finetune.methods import Job
from finetune.methods.pairs import frozen_reference, prompt_length, require_a_row_that_fits


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    """Checked, not tokenized (DPOTrainer does that): every chat row renders, and some row
    is left once DPOTrainer drops those whose prompt alone fills max_length
    (truncation_mode keep_start; keep_end drops none)."""
    value = lambda key: effective_value(experiment, key)
    max_length = value("max_length") if value("truncation_mode") == "keep_start" else None
    require_a_row_that_fits(splits, max_length, lambda row: prompt_length(tokenizer, row),
                            "DPOTrainer", "answers")
    return splits


def build_trainer(job: Job) -> DPOTrainer:
    trainer_class = DPOTrainer
    if job.experiment.data.weight_column is not None:  # a weight per preference pair
        from finetune.trainers.weighted import WeightedDPOTrainer as trainer_class
    return trainer_class(model=job.model, ref_model=frozen_reference(job), args=job.args,
                         train_dataset=job.data.train, eval_dataset=job.data.eval,
                         processing_class=job.tokenizer, callbacks=job.callbacks)
