"""Direct preference optimisation through TRL's DPOTrainer.

The reference model is passed explicitly: under LoRA TRL keeps a frozen copy of the
starting adapter; otherwise we hand it a frozen copy of the starting policy (or the
model named in dpo.ref_model). Left to itself TRL would reload the reference from
model.config.name_or_path, which is empty for a freshly initialised model.
"""

import copy

from transformers import AutoModelForCausalLM
from trl import DPOTrainer

from finetune.data.load import ORIGIN, Splits
from finetune.config.schema import Experiment
from finetune.config.effective import value as effective_value
from finetune.errors import DataError
from finetune.methods import Job
from finetune.methods.pairs import prompt_length


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    """Checked, not tokenized (DPOTrainer does that): every chat row renders, and some row
    is left once DPOTrainer drops those whose prompt alone fills max_length
    (truncation_mode keep_start; keep_end drops none)."""
    value = lambda key: effective_value(experiment, key)
    max_length = value("max_length") if value("truncation_mode") == "keep_start" else None
    for split, rows in (("train", splits.train), ("eval", splits.eval)):
        lengths = [(prompt_length(tokenizer, row), row[ORIGIN]) for row in rows or ()]
        shortest, where = min(lengths, default=(0, ""))
        if max_length is not None and shortest >= max_length:
            raise DataError(f"data.{split}: no row fits training.max_length {max_length}: "
                            "DPOTrainer drops a row whose prompt alone is that long (nothing "
                            f"of its answers would be left), and the shortest prompt, "
                            f"{where}, has {shortest} tokens; raise training.max_length, or "
                            "shorten the prompts")
    return splits


def _reference(job: Job):
    spec = job.experiment
    if spec.dpo.ref_model:
        ref = AutoModelForCausalLM.from_pretrained(
            spec.dpo.ref_model, dtype=job.hardware.model_dtype(spec, "reference"),
            trust_remote_code=spec.model.trust_remote_code)
    elif spec.peft.type != "none":
        return None
    else:
        ref = copy.deepcopy(job.model)
    ref.requires_grad_(False)
    return ref.eval()


def build_trainer(job: Job) -> DPOTrainer:
    trainer_class = DPOTrainer
    if job.experiment.data.weight_column is not None:  # a weight per preference pair
        from finetune.trainers.weighted import WeightedDPOTrainer as trainer_class
    return trainer_class(model=job.model, ref_model=_reference(job), args=job.args,
                         train_dataset=job.data.train, eval_dataset=job.data.eval,
                         processing_class=job.tokenizer, callbacks=job.callbacks)
