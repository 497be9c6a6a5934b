"""Proximal policy optimisation with our own trainer (finetune.trainers.ppo): TRL removed
its PPOTrainer in 1.13.

The reference is the starting policy: under LoRA/QLoRA the same model with its adapters
disabled, otherwise a frozen copy made here, before any checkpoint is loaded. The value
model is a copy of the policy's base (or ppo.value_model_path) with a scalar head, or a
head on the policy itself (value_model: shared). Rewards: finetune.model.rewards.
"""

from __future__ import annotations

import copy
from pathlib import Path

from finetune.data.prompts import checked_prompts
from finetune.model.rewards import reward_functions, reward_model, reward_weights
from finetune.errors import RunError
from finetune.methods import Job
from finetune.trainers.ppo import PPOTrainer
from finetune.trainers.ppo_model import PolicyAndValue, hidden_size, new_head, value_backbone
from finetune.trainers.ppo_rollout import Rewards


def _reference(job: Job):
    if job.experiment.peft.type != "none":
        return None  # the policy with its adapters disabled
    ref = copy.deepcopy(job.model)
    ref.requires_grad_(False)
    return ref.eval()


def _value_source(job: Job) -> tuple[str, str | None]:
    spec = job.experiment
    path = spec.ppo.value_model_path
    if path:
        run = Path(path)
        if (run / "experiment.yaml").is_file():  # a finetune run directory: its final model
            final = run / "final"
            # An adapter (a random-init one holds its base's config.json too) is no value model.
            if (final / "adapter_config.json").is_file() or not (final / "config.json").is_file():
                raise RunError(f"ppo.value_model_path: {run} has no full model in final/ (an "
                               "adapter-only run cannot start a value model; give a model "
                               "directory)")
            return str(final), None
        return path, None
    if spec.model.init == "random":
        return str(job.run_dir / "init-model"), None
    return spec.model.name_or_path, spec.model.revision


def prepare(splits, tokenizer, experiment):
    """Every prompt rendered and counted against the context (data/prompts.py)."""
    return checked_prompts(splits, tokenizer, experiment)


def build_trainer(job: Job) -> PPOTrainer:
    spec = job.experiment
    args = job.args
    policy = job.model
    ref = _reference(job)
    head = new_head(hidden_size(policy.config), seed=args.seed)
    backbone = None
    if spec.ppo.value_model == "separate":
        source, revision = _value_source(job)
        backbone = value_backbone(source, job.hardware.model_dtype(spec, "value"),
                                  spec.model.trust_remote_code, revision)
        if hidden_size(backbone.config) != head.in_features:
            head = new_head(hidden_size(backbone.config), seed=args.seed)
    model = PolicyAndValue(policy, head, backbone)
    if getattr(model, "quantization_method", None) is not None:
        # The Trainer leaves a bitsandbytes model where it is: place the rest ourselves.
        model.value_head.to(args.device)
        if backbone is not None:
            backbone.to(args.device)

    scorer = None, None
    if spec.rewards.model is not None:
        scorer = reward_model(spec, job.hardware.model_dtype(spec, "reward"))
    rewards = Rewards(reward_functions(spec), list(spec.rewards.functions),
                      reward_weights(spec), *scorer)
    return PPOTrainer(model=model, ref_model=ref, spec=spec.ppo, rewards=rewards, args=args,
                      train_dataset=job.data.train, eval_dataset=job.data.eval,
                      tokenizer=job.tokenizer, callbacks=job.callbacks)
