"""Every training method as one torch-free record: all that the rest of finetune needs to
know about a method, in one place.

The config layer, the data layer, the model loader, the estimate, the fingerprint and the
worker read these records instead of tables of their own, so adding a method is its
record here, its module in finetune/methods/ (`build_trainer`, and `prepare` where it
prepares its rows), and a data format in data/rows.py if it reads a new one.
tests/test_methods.py checks every record against the TRL field manifest, the data
layer, the schema and its module.

Settings are named by their dotted path in the experiment ("training.max_length",
"ppo.max_new_tokens"); config/derived/effective.py `setting` reads them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

ALL_STRATEGIES = ("none", "ddp", "fsdp", "deepspeed")


@dataclass(frozen=True)
class Reference:
    """A frozen reference the policy is compared against: a copy of the starting policy,
    or, under (Q)LoRA, the policy itself with its adapters disabled (nothing extra)."""

    # A training key whose value 0 means no reference at all (grpo's beta).
    switch: str | None = None
    # A setting naming another reference model; when set it is loaded even under (Q)LoRA.
    setting: str | None = None


@dataclass(frozen=True)
class Method:
    name: str
    # (module, class) of the config class `training:` passes through to.
    config_class: tuple[str, str]
    # Data formats it reads (data/rows.py FORMATS), in the order `auto` tries them.
    formats: tuple[str, ...]
    # "lm": a causal LM; "score": a sequence-classification head.
    head: str
    # The module of finetune.methods with build_trainer(job) and, optionally,
    # prepare(splits, tokenizer, experiment).
    module: str
    # Experiment sections that only the methods owning them read.
    sections: tuple[str, ...] = ()
    # score head: the setting listing the class names (one logit each, with id2label);
    # None: a single logit.
    labels: str | None = None
    # The setting that bounds a training sequence (None: generating methods, whose
    # prompts are bounded by the model's context).
    max_length: str | None = None
    # Generating methods: the setting that bounds a completion.
    completion_length: str | None = None
    # Sequences per sample: 2 for chosen and rejected of a preference pair.
    sequences: int = 1
    reference: Reference | None = None
    # Trains a value model besides the policy: the setting choosing a separate one or a
    # head on the policy's backbone ("separate" or "shared").
    value_model: str | None = None
    # finetune tokenizes its rows while preparing them (kept in the data cache).
    tokenizes: bool = False
    # Takes per-sample loss weights (data.weight_column).
    weights: bool = True
    # A preference pair without `prompt` takes the turns chosen and rejected share as
    # its prompt (TRL's extract_prompt), so they must share one.
    shared_prompt: bool = False
    # Supports evaluation.exact_match (greedy answers to the eval prompts).
    exact_match: bool = False
    # Trains flattened rows (padding-free or packed) where a varlen kernel runs them.
    flattens: bool = False
    # use_liger_kernel is a speed default on CUDA when liger_kernel is installed.
    liger_default: bool = False
    # use_liger_kernel's fused linear cross-entropy computes its loss (not our own loss).
    fused_loss: bool = True
    # Its TRL trainer casts the trainable parameters of a quantized model to bf16 (the
    # top-level ones do; the experimental orpo/cpo do so only for a peft_config they are
    # given, and finetune applies the adapters itself). Our own trainers do not.
    trl_casts: bool = True
    # distributed.strategy values it runs under.
    strategies: tuple[str, ...] = ALL_STRATEGIES
    # Runs under distributed.tensor_parallel (DeepSpeed AutoTP): verified on CPU for sft's
    # plain forward and loss; trainers with generation, reference models or their own
    # forward passes are not (config/rules/parallel.py).
    tensor_parallel: bool = False
    # Runs under distributed.sequence_parallel (DeepSpeed ALST/Ulysses): verified on CPU for
    # sft, whose trainer hands the Trainer's sequence-parallel loss the model's own loss.
    sequence_parallel: bool = False
    # Trains a vision-language model on rows with images (methods/sft_vision.py, dpo.py,
    # online.py for grpo and rloo).
    vision: bool = False
    # Training arguments of its own, over finetune's defaults, under the experiment's.
    defaults: dict[str, Any] = field(default_factory=dict, compare=False)

    @property
    def rewarded(self) -> bool:
        """Trained on rewards (the rewards section) rather than on labelled data."""
        return "rewards" in self.sections

    @property
    def generates(self) -> bool:
        """Generates its completions while training."""
        return self.completion_length is not None

    @property
    def logits(self) -> str:
        """Which positions of a sequence get LM logits and a loss: none (a score head
        reads one position), the completion's, or every position of the sequence."""
        if self.head == "score":
            return "none"
        return "completion" if self.generates else "sequence"

    @property
    def casts_quantized(self) -> bool:
        """Trained by a TRL trainer that casts a quantized model's trainable parameters
        to bf16 (finetune/estimate/census.py)."""
        return self.config_class[0].startswith("trl") and self.trl_casts


METHODS: dict[str, Method] = {m.name: m for m in (
    Method("sft", ("trl", "SFTConfig"), ("messages", "prompt_completion", "text"), "lm",
           "finetune.methods.sft", max_length="training.max_length", tokenizes=True,
           exact_match=True, flattens=True, liger_default=True, tensor_parallel=True,
           sequence_parallel=True, vision=True),
    Method("reward", ("trl", "RewardConfig"), ("preference",), "score",
           "finetune.methods.reward", max_length="training.max_length", sequences=2,
           tokenizes=True),
    Method("dpo", ("trl", "DPOConfig"), ("preference",), "lm", "finetune.methods.dpo",
           sections=("dpo",), max_length="training.max_length", sequences=2,
           reference=Reference(setting="dpo.ref_model"), shared_prompt=True, vision=True),
    # Reference-free preference methods (trl.experimental): the pair's own log-odds
    # (orpo) or length-normalised log-probabilities (simpo) are the implicit reward.
    # Their trainers weigh no sample, so weights are refused.
    Method("orpo", ("trl.experimental.orpo", "ORPOConfig"), ("preference",), "lm",
           "finetune.methods.orpo", max_length="training.max_length", sequences=2,
           shared_prompt=True, weights=False, trl_casts=False),
    Method("cpo", ("trl.experimental.cpo", "CPOConfig"), ("preference",), "lm",
           "finetune.methods.cpo", max_length="training.max_length", sequences=2,
           shared_prompt=True, weights=False, trl_casts=False),
    # SimPO is CPO's trainer with its simpo loss and no behaviour-cloning term, the
    # setting TRL documents for it: a name of its own so that it is asked for as such.
    Method("simpo", ("trl.experimental.cpo", "CPOConfig"), ("preference",), "lm",
           "finetune.methods.cpo", max_length="training.max_length", sequences=2,
           shared_prompt=True, weights=False, trl_casts=False,
           defaults={"loss_type": "simpo", "cpo_alpha": 0.0}),
    # Kahneman-Tversky optimisation: single completions labelled desirable or not; pairs
    # are read as two such rows (data/load.py). Its KL term compares mismatched prompt and
    # completion pairs of a batch, a second (no-grad) pass: one trained sequence per row.
    # KTOTrainer's loss weighs by label only (desirable_weight, undesirable_weight).
    Method("kto", ("trl", "KTOConfig"), ("unpaired_preference", "preference"), "lm",
           "finetune.methods.kto", sections=("kto",), max_length="training.max_length",
           reference=Reference(setting="kto.ref_model"), shared_prompt=True, weights=False,
           vision=True),
    # Our own trainers take transformers' arguments; their options are in their sections.
    Method("classify", ("transformers", "TrainingArguments"), ("classification",), "score",
           "finetune.methods.classify", sections=("classify",), labels="classify.labels",
           max_length="classify.max_length", tokenizes=True),
    Method("grpo", ("trl", "GRPOConfig"), ("prompt",), "lm", "finetune.methods.grpo",
           sections=("rewards",), completion_length="training.max_completion_length",
           reference=Reference(switch="beta"), weights=False, vision=True),
    # REINFORCE Leave-One-Out: grpo's data, rewards and generation; the baseline of each
    # completion is the mean reward of its prompt's other completions, and the KL to the
    # reference (beta, 0.05 by default) is subtracted from the reward.
    Method("rloo", ("trl", "RLOOConfig"), ("prompt",), "lm", "finetune.methods.rloo",
           sections=("rewards",), completion_length="training.max_completion_length",
           reference=Reference(switch="beta"), weights=False, vision=True),
    Method("ppo", ("transformers", "TrainingArguments"), ("prompt",), "lm",
           "finetune.methods.ppo", sections=("ppo", "rewards"),
           completion_length="ppo.max_new_tokens", reference=Reference(),
           value_model="ppo.value_model",
           weights=False, fused_loss=False, strategies=("none", "ddp")),
    # Knowledge distillation through TRL's DistillationTrainer: on-policy only (the student
    # generates from each prompt, GKD's lmbda 1) with the generalized JSD of training.beta
    # (0 forward KL, 1 reverse KL) toward the frozen teacher of distill.teacher. Prompt
    # data; sft's formats give their prompts (methods/distill.py). The loss is a token
    # mean over the generated completions: no per-sample weights.
    Method("distill", ("trl", "DistillationConfig"), ("prompt", "prompt_completion", "messages"),
           "lm", "finetune.methods.distill", sections=("distill",),
           completion_length="training.max_completion_length", weights=False, vision=True),
    # Generalized knowledge distillation through TRL's experimental GKDTrainer: the JSD of
    # training.beta toward distill.teacher's logits on the data's completions (lmbda 0: no
    # generation), the student's own samples (a fraction lmbda of the batches) or the
    # teacher's (seq_kd). Conversations only: GKD's collator renders `messages`
    # (methods/gkd.py). The loss is a token sum over the batch: no per-sample weights.
    Method("gkd", ("trl.experimental.gkd", "GKDConfig"), ("messages", "prompt_completion"),
           "lm", "finetune.methods.gkd", sections=("distill",),
           max_length="training.max_length", weights=False),
)}
NAMES = tuple(METHODS)


def method(name: str) -> Method:
    """The record of a method name (validated by the schema)."""
    return METHODS[name]


def names_where(wanted) -> list[str]:
    """Names of the methods whose record satisfies wanted(record), in record order."""
    return [m.name for m in METHODS.values() if wanted(m)]


def spoken(names: list[str] | tuple[str, ...], word: str = "and") -> str:
    """['a'] -> 'a'; ['a', 'b'] -> 'a and b'; ['a', 'b', 'c'] -> 'a, b and c'."""
    names = list(names)
    return names[0] if len(names) == 1 else f"{', '.join(names[:-1])} {word} {names[-1]}"


def formats() -> tuple[str, ...]:
    """Every data format some method reads, in record order."""
    return tuple(dict.fromkeys(f for m in METHODS.values() for f in m.formats))


def sections() -> tuple[str, ...]:
    """Every experiment section some method owns."""
    return tuple(dict.fromkeys(s for m in METHODS.values() for s in m.sections))
