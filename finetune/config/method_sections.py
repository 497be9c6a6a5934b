"""The sections of the experiment that belong to methods (the records' `sections`): the
reference models of dpo and kto, the rewards of the online methods, classify's labels
and losses, distill's teacher and ppo's options."""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from finetune.config.inputs import Input
from finetune.config.script_values import MAX_LENGTH
from finetune.config.section import Section, for_methods


class DPOSection(Section):
    ref_model: Annotated[str | None, Input("model")] = Field(
        None, description="Reference model path or hub id. Default: the starting policy "
        "(the adapter-disabled model under LoRA, a frozen copy otherwise).")


class KTOSection(Section):
    ref_model: Annotated[str | None, Input("model")] = Field(
        None, description="Reference model path or hub id. Default: the starting policy "
        "(the adapter-disabled model under LoRA, a frozen copy otherwise).")


class RewardsSection(Section):
    model: Annotated[str | None, Input("model")] = Field(
        None, description=for_methods(lambda m: m.rewarded) + "a reward model: the run "
        "directory of a `method: reward` run (its final/ model or adapter is used) or a model "
        "directory / hub id with a one-logit sequence-classification head.")
    functions: list[Annotated[str, Input("code")]] = Field(
        default_factory=list,
        description=for_methods(lambda m: m.rewarded) + "Python reward functions as "
        "'module:function' (an importable module, or a .py file relative to the YAML file). "
        "Called as f(prompts=[...], "
        "completions=[...], completion_ids=[...], trainer_state=..., **columns) and "
        "returning one float per completion (None: grpo skips it; ppo stops with an error).")
    weights: list[float] | None = Field(
        None, description="One weight per reward source, the model first, then the "
        "functions in order; default 1 each. The reward is their weighted sum.")


class ClassifySection(Section):
    labels: list[str] = Field(
        description="Class names in index order. The data's `label` is a class name or an "
        "index into this list.")
    class_weights: list[float] | Literal["balanced"] | None = Field(
        None, description="Loss weight per class (one per label), or 'balanced': "
        "n_samples / (n_classes x count) from the training labels.")
    focal_gamma: float = Field(
        0.0, ge=0, description="Focal loss exponent: (1 - p_true)^gamma scales each sample's "
        "cross-entropy; 0 is plain cross-entropy.")
    label_smoothing: float = Field(0.0, ge=0, lt=1, description="Label smoothing.")
    max_length: int = Field(512, gt=0, le=MAX_LENGTH,
                            description="Truncate texts to this many tokens.")


class DistillSection(Section):
    teacher: Annotated[str, Input("teacher")] = Field(
        description=for_methods(lambda m: "distill" in m.sections) + "the teacher whose "
        "next-token distribution the student learns: a model directory or hub id (an adapter directory loads onto its base), or "
        "the run directory of a finetune run of a causal LM (its final/ model or adapter). "
        "It must share the student's vocabulary; frozen, loaded in the dtype of a reference "
        "model (fp32 under full fine-tuning, the compute precision under LoRA/QLoRA).")


class PPOSection(Section):
    value_model: Literal["separate", "shared"] = Field(
        "separate", description="separate: a value model of its own (a copy of the policy's "
        "base with a scalar head, or value_model_path); shared: a value head on the policy's "
        "backbone. Under lora/qlora a separate value model is a full trainable copy of the "
        "base model in fp32; use shared to save memory.")
    value_model_path: Annotated[str | None, Input("model")] = Field(
        None, description="separate only: initialise the value model from this model "
        "directory (for example the reward model) instead of the policy's base.")
    max_new_tokens: int = Field(64, gt=0, le=MAX_LENGTH,
                                description="Response length limit of a rollout.")
    stop_strings: list[str] = Field(
        default_factory=list, description="A response also ends at one of these strings "
        "(it always ends at the EOS token).")
    temperature: float = Field(1.0, gt=0, description="Sampling temperature of rollouts.")
    top_k: int | None = Field(None, gt=0, le=MAX_LENGTH, description="Sample from the top k tokens only.")
    top_p: float = Field(1.0, gt=0, le=1, description="Nucleus sampling mass.")
    rollout_batches: int = Field(
        4, ge=1, le=MAX_LENGTH, description="Mini-batches per rollout: each rollout samples "
        "rollout_batches x per_device_train_batch_size x gradient_accumulation_steps prompts "
        "per process, then trains on them in that many optimizer steps per PPO epoch.")
    ppo_epochs: int = Field(4, ge=1, le=MAX_LENGTH, description="Passes over each rollout.")
    kl_coef: float = Field(0.05, ge=0, description="Per-token KL penalty coefficient "
                           "(the starting value when kl_target is set).")
    kl_target: float | None = Field(
        None, gt=0, description="Adaptive KL control: steer the coefficient so the "
        "rollout KL approaches this value.")
    kl_horizon: int = Field(10000, gt=0, le=MAX_LENGTH, description="Adaptive KL: horizon in samples.")
    gamma: float = Field(1.0, ge=0, le=1, description="Discount factor.")
    lam: float = Field(0.95, ge=0, le=1, description="GAE lambda.")
    cliprange: float = Field(0.2, gt=0, description="Policy ratio clip range.")
    cliprange_value: float = Field(0.2, gt=0, description="Value prediction clip range.")
    vf_coef: float = Field(0.1, ge=0, description="Value loss coefficient.")
    whiten_advantages: bool = Field(True, description="Normalise advantages over the "
                                    "global rollout batch.")
    missing_eos_penalty: float | None = Field(
        None, description="Subtracted from the reward of a response that ends without EOS "
        "or a stop string.")
