"""Hostile and careless experiment files and overrides (issue 13): every one is exit 0 or
exit 2 with `error:` lines naming file, line and YAML path, in a few seconds, never a
traceback; values training would refuse are refused by validate; no secret is echoed."""

from __future__ import annotations

import json
import os
import shutil
import time
from importlib.util import find_spec

import pytest

from conftest import MINIMAL_SFT as BASE, DATA, QUICKSTART, TINY_MODEL, run_cli
from finetune.cli import main



def validate(capsys, path, *overrides, seconds=5.0):
    """`finetune validate` in-process: (exit code, error lines). Any other exception
    than SystemExit escaping main() fails the test with its traceback."""
    capsys.readouterr()
    start = time.monotonic()
    code = main(["validate", str(path), *overrides])
    took = time.monotonic() - start
    err = capsys.readouterr().err
    assert took < seconds, f"validate took {took:.1f} s"
    assert code in (0, 2)
    lines = err.splitlines()
    if code == 2:
        assert lines and all(line.startswith("error: ") for line in lines), err
    assert "Traceback" not in err
    return code, lines


def refused(capsys, path, *overrides, **kw):
    code, lines = validate(capsys, path, *overrides, **kw)
    assert code == 2
    return "\n".join(lines)


BOMB = "a: &a [x, x, x, x, x, x, x, x, x, x]\n" + "".join(
    f"{chr(98 + i)}: &{chr(98 + i)} [{', '.join([f'*{chr(97 + i)}'] * 10)}]\n"
    for i in range(8))

FILES = {
    # name: (file text, what the error says)
    "non_string_key_in_training": (BASE + "training:\n  1: 2\n", ":8: "),
    "complex_key": (BASE + "training:\n  ? [a]\n  : 1\n", "a key must be text"),
    "deep_nesting": (BASE + "x: " + "[" * 5000 + "]" * 5000 + "\n", "nested"),
    "nesting_past_the_limit": (BASE + "x: " + "[" * 100 + "]" * 100 + "\n", "nested more"),
    "recursive_alias": (BASE + "training: &t\n  x: *t\n", "recursive alias"),
    "recursive_list_alias": (BASE + "x: &a [*a]\n", "recursive alias"),
    "alias_bomb": (BASE + BOMB, "expands to more than"),
    "many_values": (BASE + "x: [" + "1, " * 30_000 + "]\n", ":7: more than 20,000 values"),
    "multi_mb_scalar": (BASE + "name: " + "x" * 5_000_000 + "\n", "the most an experiment"),
    "method_list": (BASE.replace("method: sft", "method: [sft]"), "method"),
    "int_tag_overflow": (BASE + 'training:\n  seed: !!int "1e400"\n', ":8:9: YAML value error"),
    "bad_timestamp": (BASE + 'training:\n  seed: !!timestamp "x"\n', "cannot be read as timestamp"),
    "python_tag": (BASE + "training:\n  seed: !!python/name:os.system\n", ":8:"),
    "extends_unknown_user": ("extends: ~nosuchuser/x.yaml\n" + BASE, "no such experiment"),
    "extends_nul": ('extends: "a\\0b.yaml"\n' + BASE, "NUL"),
    "extends_long_component": (f"extends: {'x' * 300}.yaml\n" + BASE, "longer than 255"),
    "extends_not_a_string": ("extends: {a: 1}\n" + BASE, "extends"),
    "model_path_nul": (BASE.replace(str(TINY_MODEL), '"./a\\0b"'), "model.name_or_path"),
    "data_path_long": (BASE.replace(f"{DATA}/sft_train.jsonl", "./" + "y" * 300),
                       "data.train[0].path"),
    "model_unknown_user": (BASE.replace(str(TINY_MODEL), "~nosuchuser/m"), "no such user"),
    "huge_int_for_a_float": (BASE + f"training:\n  learning_rate: 1{'0' * 400}\n",
                             "training.learning_rate: a number of 401 digits is too large"),
    "huge_int_steps": (BASE + f"training:\n  max_steps: 1{'0' * 30}\n",
                       "training.max_steps: must fit in 64 bits"),
    "huge_length": (BASE + "training:\n  max_length: 99999999999\n",
                    "training.max_length: must be at most 2,147,483,647"),
    "infinite_section_float": (BASE + "peft: {type: lora, alpha: .inf}\n", "peft.alpha"),
    "too_many_machines": (BASE + "distributed: {num_machines: 4294967296}\n",
                          "distributed.num_machines"),
    "long_revision": (BASE + f"model: {{revision: {'a' * 300}}}\n", "model.revision: not a"),
    "nvme_path_newline": (BASE + 'distributed: {strategy: deepspeed, deepspeed: {'
                          'offload_optimizer: nvme, nvme_path: "/a\\nb"}}\n',
                          "nvme_path: contains the control character"),
}


@pytest.mark.parametrize("name", FILES)
def test_hostile_files(capsys, write, name):
    text, expected = FILES[name]
    path = write("exp.yaml", text)
    message = refused(capsys, path)
    assert expected in message and str(path) in message


def test_not_utf8_names_the_line(capsys, tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_bytes(BASE.encode() + b"name: caf\xe9\n")
    assert f"{path}:7: not UTF-8" in refused(capsys, path)


def test_nul_byte_in_file(capsys, tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_bytes(BASE.encode() + b"name: a\x00b\n")
    assert "NUL byte" in refused(capsys, path)


def test_extends_symlink_loop(capsys, write, tmp_path):
    (tmp_path / "loop.yaml").symlink_to(tmp_path / "loop.yaml")
    assert "loop.yaml" in refused(capsys, write("exp.yaml", "extends: loop.yaml\n" + BASE))


OVERRIDES = {
    "yaml_error": ("training.learning_rate={", "override"),
    "undefined_alias": ("training.learning_rate=*alias", "override"),
    "python_tag": ("training.learning_rate=!!python/name:os.system", "override"),
    "unicode_digit_key": ("data.train.²=x", "data.train"),
    "arabic_digit_key": ("data.train.٣.path=x", "data.train"),
    "int_key_in_training": ("training.1=2", "training[1]: a key must be text"),
    "deep_value": ("training.seed=" + "[" * 3000, "override"),
    "long_value_is_shortened": ("training.seed=" + "1" * 5000, "(5,014 characters)"),
}


@pytest.mark.parametrize("name", OVERRIDES)
def test_hostile_overrides(capsys, write, name):
    override, expected = OVERRIDES[name]
    assert expected in refused(capsys, write("exp.yaml", BASE), override)


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


@pytest.mark.skipif(find_spec("wandb") is not None, reason="wandb installed")
@pytest.mark.parametrize("value", ["wandb", "[wandb]", "[none, wandb]"])
def test_report_to_needs_its_package(capsys, write, value):
    message = refused(capsys, write("exp.yaml", BASE), f"training.report_to={value}")
    assert "training.report_to" in message and "pip install wandb" in message
    assert validate(capsys, write("exp.yaml", BASE), "training.report_to=none")[0] == 0


@pytest.mark.skipif(find_spec("tensorboard") or find_spec("tensorboardX"),
                    reason="tensorboard installed")
def test_report_to_tensorboard(capsys, write):
    assert "pip install tensorboard" in refused(capsys, write("exp.yaml", BASE),
                                                "training.report_to=[tensorboard]")


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


SECRET = "pa55w0rdXYZ"


@pytest.mark.parametrize("text, overrides", [
    (BASE.replace(f"{DATA}/sft_train.jsonl", f"https://user:{SECRET}@example.com/d.jsonl"), ()),
    (BASE.replace(str(TINY_MODEL), f"https://u:{SECRET}@example.com/m"), ()),
    (BASE, (f"model.name_or_path=https://u:{SECRET}@host/x y",)),
    (BASE + f"training:\n  hub_token: [{SECRET}]\n", ()),
    (BASE + f"training:\n  hub_token: {{t: {SECRET}}}\n", ()),
    (BASE, (f"training.hub_token=[{SECRET}",)),
    (BASE, (f"training.hub_token=!!int {SECRET}",)),
    (BASE + f'training:\n  hub_token: !!int "{SECRET}"\n', ()),
    (BASE, (f"training.hub_token:{SECRET}",)),  # = mistyped
    (BASE, (f"distributed.deepspeed.nvme_path=https://u:{SECRET}@host/x",)),
    (BASE, (f"training.hub_model_id=https://u:{SECRET}@host/x",)),
    (BASE, (f"output.dir=https://u:{SECRET}@host/x",)),
    (BASE, (f"data.weight_column=ftp://u:{SECRET}@host",)),
])
def test_secrets_are_not_echoed(capsys, write, text, overrides):
    message = refused(capsys, write("exp.yaml", text), *overrides)
    assert SECRET not in message


def test_subprocess_alias_bomb_and_yaml_override(write):
    path = write("exp.yaml", BASE + BOMB)
    start = time.monotonic()
    result = run_cli("validate", str(path), cwd=path.parent, timeout=60)
    assert result.returncode == 2 and "expands to more than" in result.stderr
    assert "Traceback" not in result.stderr and time.monotonic() - start < 30
    result = run_cli("validate", str(write("ok.yaml", BASE)), "training.learning_rate={",
                     cwd=path.parent, timeout=60)
    assert result.returncode == 2 and result.stderr.startswith("error: override")
    assert "Traceback" not in result.stderr


def test_mistyped_bare_model_name_online(capsys, tmp_path, monkeypatch):
    """Without HF_HUB_OFFLINE the hub would be asked for `tiny-lama` at train time; a
    near miss of a model directory next to the file is refused at validate."""
    monkeypatch.delenv("HF_HUB_OFFLINE")
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


@pytest.mark.parametrize("text", [
    BASE + 'name: "abc\\n"\n',
    BASE.replace(f"{DATA}/sft_train.jsonl", '"org/data\\n"'),
    BASE.replace(str(TINY_MODEL), '"org/model\\n"'),
])
def test_trailing_newline_does_not_pass_a_pattern(capsys, write, text):
    refused(capsys, write("exp.yaml", text))


GRPO = BASE.replace("method: sft", "method: grpo").replace(
    "sft_train", "grpo_train") + "rewards:\n  functions: [finetune.nosuch:f]\n"


@pytest.mark.parametrize("overrides, expected", [
    (["training.lr_scheduler_type=reduce_lr_on_plateau"], "training.lr_scheduler_type"),
    (["training.load_best_model_at_end=true", "training.eval_strategy=epoch",
      "data.eval_fraction=0.1"], "training.load_best_model_at_end"),
    (["training.dataloader_prefetch_factor=2", "training.dataloader_num_workers=0"],
     "training.dataloader_prefetch_factor"),
])
def test_training_arguments_cross_checks(capsys, write, overrides, expected):
    assert expected in refused(capsys, write("exp.yaml", BASE), *overrides)


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


def test_keys_and_values_with_newlines_stay_one_line(capsys, write):
    path = write("exp.yaml", BASE + '"a\\nb": 1\ntraining:\n  "x\\ny": 2\n')
    message = refused(capsys, path, "training.c\nd=1", "model.name_or_path=e\nf")
    assert "'a\\nb': unknown key" in message and "training.'x\\ny'" in message


def test_unknown_pad_token(capsys, write):
    path = write("exp.yaml", BASE)
    message = refused(capsys, path, "tokenizer.pad_token=<pad>")
    assert "tokenizer.pad_token: '<pad>' is not a token of the tokenizer" in message
    assert "<|pad|>" in message
    assert validate(capsys, path, "tokenizer.pad_token=<|pad|>")[0] == 0


def _chain(tmp_path, levels: int, fan: int) -> None:
    """b0.yaml extends b1.yaml `fan` times, and so on: read naively, fan**levels files."""
    for level in range(levels):
        (tmp_path / f"b{level}.yaml").write_text(
            f"extends: [{', '.join([f'b{level + 1}.yaml'] * fan)}]\n")
    (tmp_path / f"b{levels}.yaml").write_text("{}\n")


def test_extends_fan_out_is_bounded(capsys, tmp_path):
    _chain(tmp_path, 5, 10)
    path = tmp_path / "exp.yaml"
    path.write_text("extends: b0.yaml\n" + BASE)
    assert "more than 64 experiment files read" in refused(capsys, path, seconds=2)


def test_overrides_share_the_experiment_value_budget(capsys, write):
    many = "[" + ",".join(["1"] * 19_000) + "]"
    message = refused(capsys, write("exp.yaml", BASE), *[f"x.a{i}={many}" for i in range(15)],
                      seconds=10)
    # The second override is refused: the first spent what the experiment may hold.
    assert "override 'x.a1=" in message and "left of the experiment's 20,000" in message


@pytest.mark.parametrize("text, expected", [
    ("[]", "a DeepSpeed config is a JSON object, not list"),
    ('"x"', "not str"),
    ('{"zero_optimization": [1]}', "zero_optimization must be a JSON object"),
    ('{"zero_optimization": {"offload_optimizer": "cpu"}}',
     "zero_optimization.offload_optimizer must be a JSON object"),
    ('{"bf16": true}', "bf16 must be a JSON object"),
    ("[" * 5000 + "]" * 5000, "cannot read"),
    ('{"zero_optimization": {"stage": 3}}', "zero_optimization.stage is 3, but"),
    ('{"zero_optimization": {"stage": 2}, "nvme": "https://u:pa55@host/x"}',
     "holds credentials in a URL"),
])
def test_hand_written_deepspeed_file_of_any_shape(capsys, write, text, expected):
    file = write("ds.json", text)
    message = refused(capsys, write("exp.yaml", BASE), "distributed.strategy=deepspeed",
                      f"distributed.deepspeed.config_file={file}", "precision=fp32")
    assert expected in message and message.count("error:") == 1 and "pa55" not in message


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
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    assert validate(capsys, path, "model.name_or_path=other/model", "data.train=other/d")[0] == 0
