"""The experiment's cross-field rules and value checks: every combination or value that
training would refuse, or that would silently train something else, is refused when the
experiment is loaded (`finetune validate`), naming the YAML path.

Where to look for the other config tests (tests/config/): test_loading.py (schema, YAML,
extends, overrides, paths), test_hostile.py (hostile files and overrides), test_fuzz.py
(mutated configs), test_bundled.py (every file under configs/ validates)."""

from __future__ import annotations

import json
import os
import shutil
import socket
import sys
from importlib.util import find_spec

import pytest

from config_errors import problems, refused, validate
from conftest import MINIMAL_SFT as BASE, DATA, QUICKSTART, TINY_MODEL, run_cli
from finetune.config import load_experiment
from finetune.errors import ConfigError


def small_batches(extra: str = "") -> str:
    """sft with micro-batch 3 x accumulation 2, for checks against a DeepSpeed file."""
    return (f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 16}}\n"
            "training: {per_device_train_batch_size: 3, gradient_accumulation_steps: 2, "
            "max_steps: 2, max_grad_norm: 0.5}\n" + extra)


def jsonl(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def config_problems(write, text):
    path = write("exp.yaml", f"model:\n  name_or_path: {TINY_MODEL}\n{text}")
    return "\n".join(problems(path))


# Sections that depend on each other.


def test_cross_field_rules(write):
    path = write("exp.yaml", BASE + "peft:\n  type: lora\n  bits: 8\n"
                             "distributed:\n  device: cpu\nprecision: fp16\n")
    found = problems(path)
    assert any("peft.bits: only applies to peft.type qlora (type is lora)" in p for p in found)
    assert any("precision: fp16 needs a CUDA device" in p for p in found)

    path = write("e2.yaml", BASE.replace("data:\n", "data:\n  eval_fraction: 0.1\n  eval: x/z\n"))
    assert any("give data.eval or data.eval_fraction, not both" in p for p in problems(path))

    path = write("e3.yaml", BASE + "training:\n  eval_strategy: steps\n")
    assert any("training.eval_strategy: needs held-out data" in p for p in problems(path))

    path = write("e4.yaml", BASE + "dpo:\n  ref_model: org/model\n")
    assert any("dpo: options for method dpo, but method is sft" in p for p in problems(path))

    path = write("e5.yaml", BASE + "evaluation:\n  exact_match: true\n")
    assert any("evaluation.exact_match: needs data.eval" in p for p in problems(path))


def test_config_rules_for_new_methods(write, tmp_path):
    data = jsonl(tmp_path, [{"prompt": "x"}])
    text = config_problems(write, f"method: grpo\ndata: {{train: {data}, weight_column: w}}\n")
    assert "rewards: method grpo needs a reward" in text
    assert "data.weight_column: not used by method grpo" in text
    text = config_problems(write, f"method: ppo\ndata: {{train: {data}}}\nrewards:\n"
                                  "  functions: [nomodule, missing.py:f]\n  weights: [1]\n")
    assert "rewards.functions[0]: 'nomodule': write 'module:function'" in text
    assert "rewards.functions[1]: no such file" in text
    assert "rewards.weights: 1 weights for 2 reward source(s)" in text
    text = config_problems(write, f"method: classify\ndata: {{train: {data}}}\n")
    assert "method classify needs classify.labels" in text
    text = config_problems(write, f"method: classify\ndata: {{train: {data}}}\nclassify:\n"
                                  "  labels: [a, b]\n  class_weights: [1, -1, 2]\n")
    assert "classify.class_weights: 3 weights for 2 labels" in text
    assert "weights must be >= 0" in text
    text = config_problems(write, f"method: sft\ndata: {{train: {data}}}\n"
                                  "rewards: {functions: [m:f]}\nppo: {kl_coef: 0.1}\n")
    assert "rewards: options for methods grpo, rloo and ppo, but method is sft" in text
    assert "ppo: options for method ppo, but method is sft" in text
    text = config_problems(write, f"method: sft\ndata: {{train: {data}, weight_column: w}}\n"
                                  "training: {packing: true}\n")
    assert "training.packing: not supported with loss weights" in text


def test_distributed_rules(write):
    def found(distributed: str) -> str:
        return "\n".join(problems(write("d.yaml", BASE + f"distributed: {distributed}\n")))

    # strategy none over 2 processes is DDP (run/launched.parallel_note), not an error.
    load_experiment(write("n.yaml", BASE + "distributed: {num_processes: 2}\n"))
    assert "3 processes do not divide evenly over 2 machines" in found(
        "{strategy: ddp, num_processes: 3, num_machines: 2}")
    assert "offload_params: needs zero_stage 3" in found(
        "{strategy: deepspeed, deepspeed: {zero_stage: 2, offload_params: cpu}}")
    assert "nvme_path: required for nvme offload" in found(
        "{strategy: deepspeed, deepspeed: {offload_optimizer: nvme}}")
    assert "distributed.deepspeed: options for strategy deepspeed, but strategy is ddp" in found(
        "{strategy: ddp, num_processes: 2, deepspeed: {zero_stage: 3}}")
    assert "fsdp needs CUDA devices (accelerate runs FSDP only on accelerators)" in found(
        "{strategy: fsdp, device: cpu}")
    assert "NO_SHARD needs fsdp version 1" in found(
        "{strategy: fsdp, device: cuda, fsdp: {sharding_strategy: NO_SHARD}}")
    load_experiment(write("v1.yaml", BASE + "distributed: {strategy: fsdp, device: cuda, "
                          "fsdp: {version: 1, sharding_strategy: HYBRID_SHARD}}\n"))
    assert "strategy fsdp needs launcher accelerate" in found(
        "{strategy: fsdp, device: cuda, launcher: torchrun}")


def test_hand_written_deepspeed_file_that_contradicts_is_an_error(write, tmp_path):
    ds = tmp_path / "mine.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 3}, "bf16": {"enabled": True},
                              "train_micro_batch_size_per_gpu": 8,
                              "gradient_accumulation_steps": "auto"}))
    path = write("exp.yaml", small_batches(
        f"precision: fp32\ndistributed: {{strategy: deepspeed, num_processes: 2, "
        f"deepspeed: {{zero_stage: 2, config_file: {ds}}}}}\n"))
    with pytest.raises(ConfigError) as info:
        load_experiment(path)
    text = "\n".join(info.value.problems)
    assert "zero_optimization.stage is 3, but the experiment's distributed.deepspeed." \
           "zero_stage is 2" in text
    assert "train_micro_batch_size_per_gpu is 8, but the experiment's " \
           "training.per_device_train_batch_size is 3" in text
    assert "bf16.enabled is True, but the experiment's precision (fp32) is False" in text


def test_hand_written_offload_that_would_swap_the_optimizer_is_an_error(write, tmp_path):
    ds = tmp_path / "offload.json"
    ds.write_text(json.dumps({"zero_optimization": {"stage": 2, "offload_optimizer":
                                                    {"device": "cpu"}}}))
    path = write("exp.yaml", small_batches(f"distributed: {{strategy: deepspeed, num_processes: 2, "
                                  f"deepspeed: {{config_file: {ds}}}}}\n"))
    with pytest.raises(ConfigError, match="silently replaces training.optim with "
                                          "DeepSpeedCPUAdam"):
        load_experiment(path)


@pytest.mark.parametrize("text, expected", [
    ("[]", "a DeepSpeed config is a JSON object, not list"),
    ('"x"', "not str"),
    ('{"zero_optimization": [1]}', "zero_optimization must be a JSON object"),
    ('{"zero_optimization": {"offload_optimizer": "cpu"}}',
     "zero_optimization.offload_optimizer must be a JSON object"),
    ('{"bf16": true}', "bf16 must be a JSON object"),
    # json's recursion limit ("cannot read"), or where a worker raised it, the list it is
    ("[" * 5000 + "]" * 5000, ("cannot read", "not list")),
    ('{"zero_optimization": {"stage": 3}}', "zero_optimization.stage is 3, but"),
    ('{"zero_optimization": {"stage": 2}, "nvme": "https://u:pa55@host/x"}',
     "holds credentials in a URL"),
])
def test_hand_written_deepspeed_file_of_any_shape(capsys, write, text, expected):
    file = write("ds.json", text)
    message = refused(capsys, write("exp.yaml", BASE), "distributed.strategy=deepspeed",
                      f"distributed.deepspeed.config_file={file}", "precision=fp32")
    expected = (expected,) if isinstance(expected, str) else expected
    assert any(e in message for e in expected), message
    assert message.count("error:") == 1 and "pa55" not in message


def test_resume_rules(write, tmp_path, monkeypatch):
    path = write("exp.yaml", BASE)
    monkeypatch.chdir(tmp_path)
    assert load_experiment(path).resume == "auto" and not load_experiment(path).force_resume
    found = problems(path, "resume=runs/x/checkpoints/checkpoint-9")
    assert found == ["command line: resume: no such checkpoint directory: "
                     "runs/x/checkpoints/checkpoint-9 (auto, never, or a path relative to the "
                     "current directory)"]
    found = problems(path, "training.resume_from_checkpoint=true")
    assert any("training.resume_from_checkpoint" in p and "finetune sets it from `resume`" in p
               for p in found), found
    found = problems(path, "training.save_only_model=true")
    assert any("training.save_only_model:" in p and "resume: never" in p
               for p in found), found
    assert load_experiment(path, ["training.save_only_model=true", "resume=never"])
    assert "preemption.save_timeout" in problems(path, "preemption.save_timeout=0")[0]


# `training:` values and combinations the training arguments would refuse.


VALUES = {
    # override: the YAML path the error names
    "training.per_device_train_batch_size=0": "training.per_device_train_batch_size",
    "training.per_device_eval_batch_size=-1": "training.per_device_eval_batch_size",
    "training.gradient_accumulation_steps=0": "training.gradient_accumulation_steps",
    "training.learning_rate=.nan": "training.learning_rate: must be a finite number",
    "training.learning_rate=nan": "training.learning_rate: must be a finite number",
    "training.learning_rate=.inf": "training.learning_rate: must be a finite number",
    "training.learning_rate=-1e-4": "training.learning_rate",
    "training.seed=4294967296": "training.seed: must be between 0 and 2**32 - 1",
    "training.seed=-1": "training.seed",
    "training.data_seed=99999999999": "training.data_seed",
    "training.max_length=-5": "training.max_length: must be at least 1",
    "training.num_train_epochs=-1": "training.num_train_epochs",
    "training.warmup_steps=-3": "training.warmup_steps",
    "training.warmup_ratio=2": "training.warmup_ratio",
    "training.logging_steps=0": "training.logging_steps",
    "training.save_steps=2.5": "training.save_steps: must be a whole number",
    # steps that take floats (a fraction of the run when below 1): never int(infinity)
    "training.save_steps=.inf": "training.save_steps: must be a finite number, got inf",
    "training.logging_steps=-.inf": "training.logging_steps: must be a finite number",
    "training.eval_steps=.nan": "training.eval_steps: must be a finite number",
    "training.trust_remote_code=true": "finetune sets it from `model.trust_remote_code`",
    "method=[sft]": "method",
}


@pytest.mark.parametrize("override", VALUES)
def test_values_training_would_refuse(capsys, write, override):
    assert VALUES[override] in refused(capsys, write("exp.yaml", BASE), override)


def test_dpo_lengths_and_epochs_with_max_steps(capsys, write):
    base = BASE.replace("method: sft", "method: dpo").replace("sft_train", "pref_train")
    assert "training.max_length" in refused(capsys, write("d.yaml", base), "training.max_length=-1")
    # epochs do not matter when max_steps decides the length of the run
    assert validate(capsys, write("d.yaml", base), "training.num_train_epochs=0",
                    "training.max_steps=5")[0] == 0


@pytest.mark.parametrize("overrides, expected", [
    (["training.lr_scheduler_type=reduce_lr_on_plateau"], "training.lr_scheduler_type"),
    (["training.load_best_model_at_end=true", "training.eval_strategy=epoch",
      "data.eval_fraction=0.1"], "training.load_best_model_at_end"),
    (["training.dataloader_prefetch_factor=2", "training.dataloader_num_workers=0"],
     "training.dataloader_prefetch_factor"),
])
def test_training_arguments_cross_checks(capsys, write, overrides, expected):
    assert expected in refused(capsys, write("exp.yaml", BASE), *overrides)


GRPO = BASE.replace("method: sft", "method: grpo").replace(
    "sft_train", "grpo_train") + "rewards:\n  functions: [finetune.nosuch:f]\n"


@pytest.mark.parametrize("overrides, expected", [
    (["training.per_device_train_batch_size=3", "training.num_generations=2"],
     "training.num_generations: must divide the generation batch of 3"),
    (["training.num_generations=1"], "training.num_generations: at least 2"),
    (["training.generation_batch_size=12", "training.per_device_train_batch_size=8"],
     "training.generation_batch_size: 12 is not a multiple"),
    (["training.generation_batch_size=16", "training.steps_per_generation=2"], "not both"),
    (["training.auto_find_batch_size=true"], "training.auto_find_batch_size"),
])
def test_grpo_batch_arithmetic(capsys, write, overrides, expected):
    assert expected in refused(capsys, write("exp.yaml", GRPO), *overrides)


@pytest.mark.parametrize("training,message", [
    ("{truncation_mode: middle}", "training.truncation_mode: 'middle' is not keep_start"),
    ("{packing: true, max_length: null}", "training.packing: needs training.max_length"),
])
def test_impossible_tokenization_settings_are_config_errors(write, training, message):
    config = write("exp.yaml", f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                               f"data: {{train: t.jsonl}}\ntraining: {training}\n")
    write("t.jsonl", '{"text": "x"}\n')
    with pytest.raises(ConfigError) as info:
        load_experiment(config)
    assert any(message in p for p in info.value.problems), info.value.problems


# What the run will need: packages, model code, tokens, local or cached files.


def _not_installed(monkeypatch, *modules):
    # None in sys.modules is Python's own "this import fails": the test extra installs
    # every tracker, and the check for a missing one must run anyway.
    for module in modules:
        monkeypatch.setitem(sys.modules, module, None)


@pytest.mark.parametrize("value", ["wandb", "[wandb]", "[none, wandb]"])
def test_report_to_needs_its_package(capsys, write, monkeypatch, value):
    _not_installed(monkeypatch, "wandb")
    message = refused(capsys, write("exp.yaml", BASE), f"training.report_to={value}")
    assert "training.report_to" in message and 'pip install "finetune[wandb]"' in message
    assert validate(capsys, write("exp.yaml", BASE), "training.report_to=none")[0] == 0


def test_report_to_names_a_tracker_the_trainer_knows(capsys, write):
    """transformers refuses any other name when training starts, after the model loaded."""
    message = refused(capsys, write("exp.yaml", BASE), "training.report_to=[tensorbord]")
    assert "training.report_to[0]: 'tensorbord' is not a tracker the Trainer knows; did you " \
           "mean tensorboard? (one of azure_ml, clearml, codecarbon," in message


def test_report_to_tensorboard(capsys, write, monkeypatch):
    _not_installed(monkeypatch, "tensorboard", "tensorboardX")
    assert 'pip install "finetune[tensorboard]"' in refused(capsys, write("exp.yaml", BASE),
                                                "training.report_to=[tensorboard]")


def test_attention_accepts_what_transformers_accepts(write):
    # flash_attention_3 and hub kernels need packages: test_attention_needs_its_package
    for name in ("flex_attention", "finetune_varlen", "eager"):
        exp = load_experiment(write("exp.yaml", BASE), [f"model.attn_implementation={name}"])
        assert exp.model.attn_implementation == name
    path = write("exp.yaml", BASE.replace("init: random\n",
                                          "init: random\n  attn_implementation: flash_attn2\n"))
    [problem] = problems(path)
    assert problem.startswith(f"{path}:5: model.attn_implementation: 'flash_attn2' is not an "
                              "attention implementation: use one of auto, finetune_varlen")


@pytest.mark.skipif(find_spec("flash_attn") or find_spec("kernels"), reason="installed")
@pytest.mark.parametrize("name", ["flash_attention_2", "flash_attention_3",
                                  "kernels-community/flash-attn2"])
def test_attention_needs_its_package(capsys, write, name):
    message = refused(capsys, write("exp.yaml", BASE), f"model.attn_implementation={name}")
    assert "model.attn_implementation" in message and "pip install" in message


def test_mistyped_bare_model_name_offline(capsys, tmp_path):
    shutil.copytree(QUICKSTART / "data", tmp_path / "data")  # no model directory beside
    text = (QUICKSTART / "sft.yaml").read_text().replace("name_or_path: tiny-llama",
                                                         "name_or_path: tiny-lama")
    path = tmp_path / "sft.yaml"
    path.write_text(text)
    assert os.environ["HF_HUB_OFFLINE"] == "1"  # conftest
    message = refused(capsys, path)
    assert f"{path}:7: model.name_or_path: 'tiny-lama' is not a local directory" in message
    assert "offline" in message
    # a subprocess, as a user types it
    result = run_cli("validate", str(path), cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.startswith("error: ")


def test_mistyped_bare_model_name_online(capsys, tmp_path, online):
    """Without HF_HUB_OFFLINE the hub would be asked for `tiny-lama` at train time; a
    near miss of a model directory next to the file is refused at validate."""
    shutil.copytree(TINY_MODEL, tmp_path / "tiny-llama")
    path = tmp_path / "exp.yaml"
    path.write_text(BASE.replace(str(TINY_MODEL), "tiny-lama"))
    message = refused(capsys, path)
    assert f"{path}:3: model.name_or_path: 'tiny-lama' is not a local directory" in message
    assert "did you mean tiny-llama?" in message
    # an override that fixes it wins; hub names far from any directory stay hub names
    assert validate(capsys, path, f"model.name_or_path={tmp_path}/tiny-llama")[0] == 0
    path.write_text(BASE.replace(str(TINY_MODEL), "gpt2"))
    assert validate(capsys, path)[0] == 0


def test_paths_written_from_the_current_directory_or_mistyped_are_named_with_the_fix(
        capsys, tmp_path, monkeypatch):
    """An experiment in configs/ naming `models/tiny` (a directory of the current directory,
    not of configs/), and a data file one letter from the file beside it: each error says
    how to write it."""
    monkeypatch.chdir(tmp_path)
    shutil.copytree(TINY_MODEL, tmp_path / "models" / "tiny")
    (tmp_path / "configs" / "data").mkdir(parents=True)
    data = tmp_path / "configs" / "data" / "sft_train.jsonl"
    shutil.copy(DATA / "sft_train.jsonl", data)
    path = tmp_path / "configs" / "exp.yaml"
    path.write_text(f"method: sft\nmodel: {{name_or_path: models/tiny, init: random}}\n"
                    f"data: {{train: {data}}}\n")
    message = refused(capsys, path)
    assert ("model.name_or_path: 'models/tiny' is not a directory next to the YAML file "
            f"({path.parent}): paths in an experiment are relative to the file that names "
            "them, and this one is relative to the current directory; write ../models/tiny "
            "(or the absolute path)") in message
    path.write_text(f"method: sft\nmodel: {{name_or_path: ../models/tiny, init: random}}\n"
                    f"data: {{train: {data.with_name('sft_trian.jsonl')}}}\n")
    message = refused(capsys, path)
    assert (f"no such file or directory: {data.with_name('sft_trian.jsonl')}; did you mean "
            f"{data}?") in message
    # written relative to the YAML file, as the quickstart writes its data
    path.write_text("method: sft\nmodel: {name_or_path: ../models/tiny, init: random}\n"
                    "data: {train: data/sft_trian.jsonl}\n")
    assert (f"no such file or directory: {data.with_name('sft_trian.jsonl')}; did you mean "
            f"{data}?") in refused(capsys, path)


def test_model_with_custom_code_needs_trust(capsys, write, tmp_path):
    model = tmp_path / "custom"
    shutil.copytree(TINY_MODEL, model)
    config = json.loads((model / "config.json").read_text())
    config["auto_map"] = {"AutoModelForCausalLM": "modeling_x.XForCausalLM"}
    (model / "config.json").write_text(json.dumps(config))
    path = write("exp.yaml", BASE.replace(str(TINY_MODEL), str(model)))
    message = refused(capsys, path)
    assert message.count("error:") == 1 and "model.trust_remote_code: true" in message
    assert validate(capsys, path, "model.trust_remote_code=true")[0] == 0


def test_hub_models_not_cached_are_asked_for_once_online(capsys, write, tmp_path, online,
                                                        monkeypatch):
    """Online, a model id neither local nor cached is looked up on the hub once, with a
    short timeout and no retries, before anything is loaded: a name the hub does not have
    (a mistyped bare name, most often) or a hub that cannot be reached is refused by
    validate in one line, where training would spend ~30-60 s in retries first."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    online.models = {"someorg/real-model"}
    path = write("exp.yaml", BASE.replace(str(TINY_MODEL), "tiny-lama"))
    message = refused(capsys, path)
    assert f"model.name_or_path: 'tiny-lama' is neither a model on the hub ({online.url} " \
           "has none by that name; a private one needs `hf auth login` or HF_TOKEN) nor a " \
           "local directory (paths in an experiment are relative to the YAML file" in message
    assert online.asked == ["/api/models/tiny-lama"]  # once: no retries
    assert validate(capsys, path, "model.name_or_path=someorg/real-model")[0] == 0
    assert validate(capsys, path, "model.name_or_path=someorg/real-model",
                    "model.revision=v2")[0] == 0
    assert "/api/models/someorg/real-model/revision/v2" in online.asked[-1]
    # a cached model is not asked for (transformers falls back on the cache)
    (tmp_path / "hf" / "hub" / "models--tiny-lama").mkdir(parents=True)
    asked = len(online.asked)
    assert validate(capsys, path)[0] == 0 and len(online.asked) == asked
    # a hub that cannot be reached: refused, saying so, from the CLI in one line
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        monkeypatch.setenv("HF_ENDPOINT", f"http://127.0.0.1:{closed.getsockname()[1]}")
        result = run_cli("validate", str(path), "model.name_or_path=someorg/other",
                         cwd=tmp_path, timeout=60)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr
    assert "model.name_or_path: 'someorg/other' is not in the local cache" in result.stderr
    assert "could not be reached (ConnectError" in result.stderr


def test_unknown_pad_token(capsys, write):
    path = write("exp.yaml", BASE)
    message = refused(capsys, path, "tokenizer.pad_token=<pad>")
    assert "tokenizer.pad_token: '<pad>' is not a token of the tokenizer" in message
    assert "<|pad|>" in message
    assert validate(capsys, path, "tokenizer.pad_token=<|pad|>")[0] == 0


def test_hub_ids_must_be_cached_offline(capsys, write, tmp_path, monkeypatch):
    """Offline, a hub model or dataset that is not in the local caches cannot be
    fetched at train time either: refused by validate, with where it looked."""
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    path = write("exp.yaml", BASE)
    message = refused(capsys, path, "model.name_or_path=someorg/no-such-model",
                      "data.train=someorg/no-such-data")
    assert "model.name_or_path: 'someorg/no-such-model' is not a local directory, and " \
           "cannot be fetched from the hub offline (HF_HUB_OFFLINE set" in message
    assert "data.train[0].path: 'someorg/no-such-data'" in message
    (tmp_path / "hf" / "hub" / "models--someorg--no-such-model").mkdir(parents=True)
    (tmp_path / "hf" / "datasets" / "someorg___no-such-data").mkdir(parents=True)
    assert validate(capsys, path, "model.name_or_path=someorg/no-such-model",
                    "data.train=someorg/no-such-data")[0] == 0
    # online: test_hub_models_not_cached_are_asked_for_once_online
