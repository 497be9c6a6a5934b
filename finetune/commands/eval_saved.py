"""`finetune eval`'s torch side: the method's trainer built as training builds it
(run/build.py: the same tokenizer, prepared data, starting model, adapters and reference),
the saved weights (final/ or a checkpoint) loaded into its model as a resume would, then
evaluated as training evaluates (run/evaluation.py). Nothing is trained, nothing is written
into the run directory (the data cache next to it aside)."""

from __future__ import annotations

import tempfile
from pathlib import Path
from typing import Any

from finetune.run.build import method_trainer, starting_model, tokenizer_and_data, without_redacted
from finetune.config.schema import Experiment
from finetune.errors import RunError
from finetune.run.evaluation import evaluate
from finetune.model.hardware import checkpointing_decision, resolve_hardware
from finetune.methods import Job
from finetune.model.load import load_weights

INIT_MODEL = "init-model"


def _from_saved_start(experiment: Experiment, run_dir: Path) -> Experiment:
    """A model.init random run starts from the weights it saved in init-model/ (drawn
    again, on another device, they would differ); the reference of dpo and ppo is a copy
    of that starting model, as in training."""
    if experiment.model.init != "random":
        return experiment
    model = experiment.model.model_copy(update={
        "name_or_path": str(run_dir / INIT_MODEL), "init": "pretrained", "revision": None})
    return experiment.model_copy(update={"model": model})


def _load_saved(model, directory: Path) -> None:
    """The saved weights into the built model, in place: ppo's policy-and-value module
    reads its own layout (value/ beside the policy), every other model the Trainer's."""
    from finetune.trainers.ppo_model import PolicyAndValue

    try:
        if isinstance(model, PolicyAndValue):
            model.load(directory)
        else:
            load_weights(model, directory)
    except FileNotFoundError as exc:
        missing = Path(exc.filename).name if exc.filename else str(exc)
        raise RunError(f"{directory}: no saved weights to evaluate ({missing} is missing); "
                       "was it saved by another kind of run (peft type, sharded)?") from None
    except ValueError as exc:
        raise RunError(f"{directory}: the saved weights do not fit the run's model: "
                       f"{exc}") from None


def evaluate_saved(experiment: Experiment, run_dir: Path,
                   weights: Path | None) -> dict[str, Any]:
    """Evaluate the weights saved in `weights` (None: the experiment's starting model) on
    the experiment's eval data. run_dir: the run's directory (its init-model/, and the
    data cache beside it)."""
    experiment = without_redacted(experiment)
    hw = resolve_hardware(experiment)
    tokenizer, data = tokenizer_and_data(experiment, run_dir)
    checkpointing, _ = checkpointing_decision(experiment, hw)
    with tempfile.TemporaryDirectory(prefix="finetune-eval-") as folder:
        # The training arguments' output_dir, and where a starting model drawn here is
        # saved to be loaded back (quantized): never the run directory.
        scratch = Path(folder)
        if weights is None:  # the starting model itself
            built, home = experiment, scratch
        else:
            built, home = _from_saved_start(experiment, run_dir), run_dir
        args, model = starting_model(built, hw, tokenizer, scratch, 0, scratch, checkpointing)
        job = Job(experiment=experiment, run_dir=home, hardware=hw, tokenizer=tokenizer,
                  model=model, data=data, args=args)
        trainer = method_trainer(job)
        if weights is not None:
            _load_saved(trainer.model, weights)
        metrics, scored = evaluate(trainer, job)
    return {"metrics": metrics, "exact_match": scored, "rows": len(data.eval),
            "device": hw.device, "precision": hw.precision}
