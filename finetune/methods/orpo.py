"""Odds-ratio preference optimisation through TRL's ORPOTrainer (trl.experimental): the
policy's NLL on the chosen answer plus beta times the log-odds-ratio loss of chosen over
rejected; no reference model. The trainer tokenizes the pairs itself; prepare checks
them (methods/pairs.py). The adapters are finetune's (no peft_config is passed)."""

from trl.experimental.orpo import ORPOTrainer

from finetune.config.schema import Experiment
from finetune.data.load import Splits
from finetune.methods import Job
from finetune.methods.pairs import prepare_unreferenced


def prepare(splits: Splits, tokenizer, experiment: Experiment) -> Splits:
    return prepare_unreferenced(splits, tokenizer, experiment, "ORPOTrainer")


def build_trainer(job: Job) -> ORPOTrainer:
    return ORPOTrainer(model=job.model, args=job.args, train_dataset=job.data.train,
                       eval_dataset=job.data.eval, processing_class=job.tokenizer,
                       callbacks=job.callbacks)
