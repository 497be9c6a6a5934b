"""Contrastive preference optimisation through TRL's CPOTrainer (trl.experimental), for
`method: cpo` and `method: simpo` (its record sets loss_type simpo and cpo_alpha 0: the
length-normalised log-probability margin over simpo_gamma, no NLL term). No reference
model. The trainer tokenizes the pairs itself; prepare checks them (methods/pairs.py).
The adapters are finetune's (no peft_config is passed)."""

from trl.experimental.cpo import CPOTrainer

from finetune.config.schema import Experiment
from finetune.data.load import Splits
from finetune.methods import Job
from finetune.methods.pairs import prepare_unreferenced


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    return prepare_unreferenced(splits, tokenizer, experiment, "CPOTrainer")


def build_trainer(job: Job) -> CPOTrainer:
    return CPOTrainer(model=job.model, args=job.args, train_dataset=job.data.train,
                      eval_dataset=job.data.eval, processing_class=job.tokenizer,
                      callbacks=job.callbacks)
