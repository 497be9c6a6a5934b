"""Direct preference optimisation through TRL's DPOTrainer.

The reference model is passed explicitly: under LoRA TRL keeps a frozen copy of the
starting adapter; otherwise we hand it a frozen copy of the starting policy (or the
model named in dpo.ref_model). Left to itself TRL would reload the reference from
model.config._name_or_path, which is empty for a freshly initialised model.
"""

import copy

from transformers import AutoModelForCausalLM
from trl import DPOTrainer

from finetune.methods import Job


def _reference(job: Job):
    spec = job.experiment
    if spec.dpo.ref_model:
        ref = AutoModelForCausalLM.from_pretrained(
            spec.dpo.ref_model, dtype=job.model.dtype,
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
