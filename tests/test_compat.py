"""finetune/compat.py against the installed libraries: every private attribute it reads is
where it says, on real tiny trainers (the quickstart's tiny Llama, random weights) at the
moment finetune uses it; every private method finetune overrides or calls takes the
parameters relied on; no override of a library's private method goes unrecorded; and
the workarounds still work, and are still needed."""

from __future__ import annotations

import importlib
import inspect
import json
from importlib import metadata

import pytest
import torch
from datasets import Dataset
from transformers import (AutoConfig, AutoModelForCausalLM, AutoModelForSequenceClassification,
                          AutoTokenizer, Trainer, TrainerCallback, TrainingArguments)

from conftest import DATA, REPO, TINY_MODEL
from finetune import compat

# One worker runs this module: its module fixture (seen) trains once, not once per worker.
pytestmark = pytest.mark.xdist_group("compat")

# finetune's Trainer subclasses: each private method they define that a library class
# also defines must be in compat.OVERRIDES.
OURS = ("finetune.trainers.classify:ClassifyTrainer",
        "finetune.trainers.weighted:WeightedSFTTrainer",
        "finetune.trainers.weighted:WeightedRewardTrainer",
        "finetune.trainers.weighted:WeightedDPOTrainer",
        "finetune.trainers.ppo:PPOTrainer",
        "finetune.trainers.vision:VisionSFTTrainer",
        "finetune.trainers.vision:VisionDPOTrainer",
        "finetune.trainers.vision:VisionKTOTrainer",
        "finetune.methods.grpo:ResumableGRPOTrainer",
        "finetune.methods.grpo:ResumableVisionGRPOTrainer",
        "finetune.methods.distill:ResumableDistillationTrainer",
        "finetune.methods.distill:ResumableVisionDistillationTrainer",
        "finetune.methods.rloo:ResumableRLOOTrainer",
        "finetune.methods.rloo:ResumableVisionRLOOTrainer",
        "finetune.methods.gkd:ProcessScaledGKDTrainer")
# PPOTrainer's own private instance attributes: a Trainer must not have them already.
PPO_OWN = ("_micro", "_position", "_stats", "_stat_steps")
CPU = dict(report_to="none", use_cpu=True, bf16=False, fp16=False, save_strategy="no",
           disable_tqdm=True, seed=0)


def _class(path: str):
    module, name = path.split(":")
    return getattr(importlib.import_module(module), name)


def _ours(cls) -> bool:
    return cls.__module__.startswith("finetune.")


def _model(seed: int = 0, **kwargs):
    torch.manual_seed(seed)
    return AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(TINY_MODEL), **kwargs)


def _rows(name: str, count: int) -> list[dict]:
    return [json.loads(line) for line in (DATA / name).read_text().splitlines()[:count]]


def test_written_for_the_installed_and_pinned_versions():
    pins = dict(line.split("==") for line in (REPO / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    for package, version in compat.WRITTEN_FOR.items():
        assert pins[package] == version, f"constraints.txt pins {package} {pins[package]}: " \
            f"check every entry of finetune/compat.py against it, then bump WRITTEN_FOR"
        assert metadata.version(package) == version, \
            f"{package} {metadata.version(package)} is installed, compat.py was written for " \
            f"{version}: check its entries against the installed sources"


@pytest.mark.parametrize("member", compat.OVERRIDES, ids=lambda m: f"{m.owner}.{m.name}")
def test_overridden_private_methods_take_the_same_parameters(member):
    owner = _class(member.owner)
    assert member.name in vars(owner), f"{member.owner} no longer defines {member.name}"
    found = tuple(inspect.signature(getattr(owner, member.name)).parameters)[1:]
    assert found == member.parameters, f"{member.owner}.{member.name}{found}: overridden by " \
        f"{member.users} with {member.parameters}"
    for user in member.users.split():
        cls = _class(user)
        library = next(c for c in cls.__mro__ if not _ours(c) and member.name in vars(c))
        assert library is owner, f"{user} overrides {library.__name__}.{member.name} now"
        assert any(_ours(c) and member.name in vars(c) for c in cls.__mro__), \
            f"{user} no longer overrides {member.name}: drop it from compat.OVERRIDES"


@pytest.mark.parametrize("member", compat.CALLED, ids=lambda m: f"{m.owner}.{m.name}")
def test_called_private_methods_take_the_parameters_passed(member):
    method = getattr(_class(member.owner), member.name, None)
    assert callable(method), f"{member.owner} has no {member.name} (called by {member.users})"
    found = set(inspect.signature(method).parameters)
    assert set(member.parameters) <= found, f"{member.owner}.{member.name} takes {found}"


def test_every_override_of_a_library_private_method_is_recorded():
    recorded = {(user, m.name) for m in compat.OVERRIDES for user in m.users.split()}
    for path in OURS:
        cls = _class(path)
        library = [c for c in cls.__mro__ if not _ours(c)]
        for name in {n for c in cls.__mro__ if _ours(c) for n in vars(c)}:
            private = name.startswith("_") and not name.startswith("__")
            if private and any(name in vars(c) for c in library):
                assert (path, name) in recorded, f"{path} overrides {name}: record it in " \
                    "compat.OVERRIDES"


# ---- private attributes, on real trainers ----

class _Probe(TrainerCallback):
    """Sees the trainer (set after it is built) at each point finetune uses it."""

    def __init__(self, at_begin=None):
        self.trainer, self.at_begin = None, at_begin
        self.names: set[str] = set()
        self.windows: list = []
        self.logged: list[float] = []
        self.generation = None

    def on_train_begin(self, args, state, control, **kwargs):
        self.names = set(dir(self.trainer))
        if self.at_begin:
            self.at_begin(self.trainer)

    def on_step_end(self, args, state, control, **kwargs):
        loss_sum, since = compat.loss_window(self.trainer)
        self.windows.append((float(loss_sum), since))
        if hasattr(self.trainer, "_buffered_inputs"):
            self.generation = compat.grpo_generation(self.trainer)

    def on_log(self, args, state, control, logs=None, **kwargs):
        if "loss" in logs:
            self.logged.append(logs["loss"])


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


@pytest.fixture(scope="module")
def seen(tmp_path_factory, tokenizer) -> dict[str, set[str]]:
    """owner -> the attribute names of a real instance where finetune uses them."""
    out = {"transformers:PretrainedConfig": set(dir(_model().config))}
    from trl import DPOConfig, DPOTrainer, RewardConfig, RewardTrainer

    path = tmp_path_factory.mktemp("compat")
    pairs = Dataset.from_list(_rows("pref_train.jsonl", 4))
    reward_model = AutoModelForSequenceClassification.from_config(
        AutoConfig.from_pretrained(TINY_MODEL, num_labels=1))
    reward = RewardTrainer(model=reward_model, processing_class=tokenizer, train_dataset=pairs,
                           args=RewardConfig(output_dir=str(path / "reward"), max_length=64,
                                             **CPU))
    out["trl:RewardTrainer"] = set(dir(reward))
    dpo = DPOTrainer(model=_model(), ref_model=_model(), processing_class=tokenizer,
                     train_dataset=pairs,
                     args=DPOConfig(output_dir=str(path / "dpo"), max_length=64, **CPU))
    out["trl:DPOTrainer"] = set(dir(dpo))
    # What WeightedDPOTrainer reads: public names, undocumented.
    for name in ("loss_types", "f_divergence_type", "ld_alpha", "use_weighting",
                 "aux_loss_enabled", "precompute_ref_logps", "label_smoothing", "beta",
                 "compute_ref_log_probs", "ref_model"):
        assert hasattr(dpo, name), f"DPOTrainer has no {name} (WeightedDPOTrainer reads it)"
    return out


def test_the_trainer_logs_the_loss_window_compat_reopens(tmp_path):
    """At on_train_begin the window is empty; reopened there with a sum of 6.0 from step
    -1, the log at step 2 is (6 + loss 1 + loss 2) / 3 and the window then restarts."""
    rows = Dataset.from_dict({"input_ids": [list(range(3, 19))] * 8,
                              "labels": [list(range(3, 19))] * 8})
    args = TrainingArguments(output_dir=str(tmp_path), max_steps=3, logging_steps=2,
                             per_device_train_batch_size=2, **CPU)
    begin = []

    def reopen(trainer):
        begin.append(tuple(float(v) for v in compat.loss_window(trainer)))
        compat.set_loss_window(trainer, torch.tensor(6.0), -1)

    probe = _Probe(reopen)
    trainer = Trainer(model=_model(), args=args, train_dataset=rows, callbacks=[probe])
    probe.trainer = trainer
    assert compat.signature_columns(trainer) is None
    trainer.train()
    assert begin == [(0.0, 0)]
    (s1, a), (s2, b), (s3, c) = probe.windows
    assert (a, b, c) == (-1, -1, 2) and s1 > 6.0 and s2 > s1
    assert probe.logged[0] == pytest.approx(s2 / 3, rel=1e-5)
    assert "input_ids" in compat.signature_columns(trainer)
    for member in compat.ATTRIBUTES:
        if member.owner == "transformers:Trainer":
            assert member.name in probe.names, f"Trainer has no {member.name} at on_train_begin"
    clash = [name for name in PPO_OWN if name in probe.names]
    assert not clash, f"PPOTrainer's own attributes {clash} are the Trainer's now"


@pytest.mark.parametrize("name", ["GRPO", "RLOO"])
def test_grpo_keeps_its_generation_window_where_compat_reads_it(name, tmp_path, tokenizer):
    """One step of steps_per_generation 2: the buffer holds 2 batches, the micro-step
    count is 1, the metrics of the step wait for the log. Without PEFT and with beta > 0
    the reference is loaded from where compat.grpo_reference_from points. RLOOTrainer
    keeps the same state (methods/online.py serves both)."""
    import trl
    GRPOConfig, GRPOTrainer = getattr(trl, f"{name}Config"), getattr(trl, f"{name}Trainer")

    def length(completions, **kwargs):
        return [float(len(c)) for c in completions]

    model = _model()
    init = tmp_path / "init-model"
    model.save_pretrained(init)
    model.config.name_or_path = ""  # as `model.init: random` leaves it
    args = GRPOConfig(output_dir=str(tmp_path / "out"), max_steps=1, logging_steps=1,
                      per_device_train_batch_size=2, num_generations=2, steps_per_generation=2,
                      max_completion_length=4, beta=0.04, activation_checkpointing=False, **CPU)
    probe = _Probe()
    prompts = Dataset.from_dict({"prompt": ["sort: b a", "sort: d c", "sort: f e", "sort: h g"]})
    with compat.grpo_reference_from(model.config, str(init)):
        trainer = GRPOTrainer(model=model, reward_funcs=[length], args=args,
                              train_dataset=prompts, processing_class=tokenizer,
                              callbacks=[probe])
    assert model.config.name_or_path == ""
    reference = trainer.ref_model.state_dict()
    assert all(torch.equal(v, reference[k]) for k, v in model.state_dict().items())
    probe.trainer = trainer
    names = set(dir(trainer))
    for member in compat.ATTRIBUTES:
        if member.owner == f"trl:{name}Trainer":
            assert member.name in names, f"{name}Trainer has no {member.name} after __init__"
    start = compat.grpo_generation(trainer)
    assert (start.step, start.buffer, start.metrics) == (0, None, {})
    trainer.train()
    window = probe.generation
    assert window.step == 1 and len(window.buffer) == 2 and "reward" in window.metrics
    compat.set_grpo_generation(trainer, compat.GenerationWindow(7, None, {"reward": [1.0]}))
    again = compat.grpo_generation(trainer)
    assert (again.step, again.buffer, again.metrics) == (7, None, {"reward": [1.0]})


@pytest.mark.parametrize("member", [m for m in compat.ATTRIBUTES if m.owner not in (
    "transformers:Trainer", "trl:GRPOTrainer", "trl:RLOOTrainer")], ids=lambda m: f"{m.owner}.{m.name}")
def test_private_attributes_exist_on_built_objects(member, seen):
    assert member.name in seen[member.owner], f"{member.owner} has no {member.name} " \
        f"(compat: {member.users})"


def test_attention_implementation_is_the_models():
    assert compat.attention_implementation(_model(attn_implementation="eager")) == "eager"
    assert compat.attention_implementation(_model(attn_implementation="sdpa")) == "sdpa"


def test_sft_trainer_takes_our_tokens_only_with_its_checks_off(tmp_path, tokenizer):
    """SFTTrainer still refuses assistant_only_loss on tokenized rows and padding_free
    with max_length (so the workaround is still needed), and builds with them off."""
    from trl import SFTConfig, SFTTrainer

    ids = tokenizer("sort: b a")["input_ids"]
    rows = Dataset.from_dict({"input_ids": [ids] * 4, "labels": [ids] * 4})

    def build(**settings):
        args = SFTConfig(output_dir=str(tmp_path), dataset_kwargs={"skip_prepare_dataset": True},
                         **settings, **CPU)
        return args, lambda: SFTTrainer(model=_model(), args=args, train_dataset=rows,
                                        processing_class=tokenizer)

    for settings, refused in (({"assistant_only_loss": True}, "assistant_only_loss"),
                              ({"padding_free": True, "max_length": 32}, "max_length")):
        args, make = build(**settings)
        with pytest.raises(ValueError, match=refused):
            make()
        with compat.sft_trainer_on_our_tokens(args):
            make()
        assert all(getattr(args, k) == v for k, v in settings.items())
