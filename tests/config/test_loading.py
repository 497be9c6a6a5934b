"""Experiment loading: schema, errors with YAML paths and lines, extends, overrides, paths,
defaults, the resolved file. (Cross-field rules and value checks: test_rules.py.)"""

from __future__ import annotations

import textwrap

import pytest
import yaml

from config_errors import problems
from conftest import MINIMAL_SFT as BASE, DATA
from finetune.config import load_experiment
from finetune.errors import ConfigError
from finetune.render.bundle import resolved_yaml


def test_minimal_experiment_fills_defaults(write):
    exp = load_experiment(write("exp.yaml", BASE))
    assert exp.name == "exp"  # from the file name
    assert exp.precision == "auto" and exp.peft.type == "none"
    assert exp.data.train[0].path == f"{DATA}/sft_train.jsonl"
    dumped = yaml.safe_load(resolved_yaml(exp))
    assert dumped["peft"]["r"] == 16 and dumped["output"]["save_final"] is True


def test_unknown_key_names_path_line_and_suggestion(write):
    path = write("exp.yaml", BASE + "training:\n  max_steps: 3\n  learning_rat: 1e-4\n")
    [problem] = problems(path)
    assert problem == (f"{path}:9: training.learning_rat: unknown key: not a field of "
                       "trl.SFTConfig; did you mean learning_rate?")


def test_flat_trl_style_training_keys_get_one_hint(write):
    path = write("exp.yaml", BASE + "learning_rate: 2e-4\nper_device_train_batch_size: 8\n"
                                    "num_train_epochs: 1\noutput_dir: out\nlerning: 3\n")
    assert problems(path) == [
        f"{path}:7: learning_rate, per_device_train_batch_size, num_train_epochs: these are "
        "`training:` fields: move them under `training:`",
        f"{path}:10: output_dir: unknown key: finetune sets it from `output.dir`",
        f"{path}:11: lerning: unknown key, did you mean training?"]
    # the method's own class decides (beta is DPOConfig's, not SFTConfig's); an override
    # is named as one
    assert problems(path, "beta=0.1")[0].startswith(f"{path}:7: learning_rate, "
                                                     "per_device_train_batch_size, "
                                                     "num_train_epochs: these")
    assert "command line: beta: unknown key" in "\n".join(problems(path, "beta=0.1"))
    dpo = write("dpo.yaml", BASE.replace("method: sft", "method: dpo") + "beta: 0.1\n")
    assert problems(dpo)[0] == (f"{dpo}:7: beta: these are `training:` fields: move them "
                                "under `training:`")


def test_unknown_section_key_suggests(write):
    path = write("exp.yaml", BASE + "peft:\n  type: lora\n  rr: 8\n")
    assert problems(path) == [f"{path}:9: peft.rr: unknown key, did you mean r?"]


def test_every_problem_reported_at_once(write):
    path = write("exp.yaml", BASE + textwrap.dedent("""\
        precision: fp64
        training:
          max_steps: thirty
          lr_scheduler_type: cosin
          bf16: true
        """))
    found = problems(path)
    assert len(found) == 4, found
    text = "\n".join(found)
    assert f"{path}:7: precision:" in text and "'fp64'" in text
    assert "training.max_steps: expected int, got str 'thirty' (trl.SFTConfig.max_steps)" in text
    assert "did you mean 'cosine'?" in text
    assert "training.bf16: not set here: finetune sets it from `precision`" in text


def test_method_decides_training_class(write):
    path = write("exp.yaml", BASE.replace("method: sft", "method: dpo").replace(
        "sft_train", "pref_train") + "training:\n  beta: 0.2\n  packing: true\n")
    [problem] = problems(path)
    assert "training.packing: unknown key: not a field of trl.DPOConfig" in problem


def test_numbers_in_yaml_and_overrides_are_typed(write):
    path = write("exp.yaml", BASE + "training:\n  learning_rate: 1e-4\n  max_steps: 10\n")
    exp = load_experiment(path, ["training.max_steps=20", "peft.type=lora", "peft.r=32",
                                 "training.weight_decay=1e-2"])
    assert exp.training == {"learning_rate": 1e-4, "max_steps": 20, "weight_decay": 0.01}
    assert isinstance(exp.training["learning_rate"], float)
    assert exp.peft.r == 32


def test_override_errors_say_command_line(write):
    path = write("exp.yaml", BASE)
    assert problems(path, "peft.alpah=4") == ["command line: peft.alpah: unknown key, did you mean alpha?"]
    with pytest.raises(ConfigError, match="expected key.sub=value"):
        load_experiment(path, ["peft.r"])


def test_extends_merges_and_resolves_paths_per_file(write, tmp_path):
    base = write("base/base.yaml", BASE + "training:\n  max_steps: 5\n  learning_rate: 0.1\n")
    assert load_experiment(base).training["max_steps"] == 5
    (tmp_path / "base" / "extra.jsonl").write_text('{"text": "hello"}\n')
    child = write("child.yaml", textwrap.dedent("""\
        extends: base/base.yaml
        name: child-run
        training:
          max_steps: 7
        data:
          eval: base/extra.jsonl
        """))
    exp = load_experiment(child)
    assert exp.name == "child-run"
    assert exp.training == {"max_steps": 7, "learning_rate": 0.1}
    assert exp.data.eval[0].path == str(tmp_path / "base" / "extra.jsonl")
    # an error in the base names the base file and line
    write("base/base.yaml", BASE + "training:\n  max_stepz: 5\n")
    [problem] = problems(child)
    assert problem.startswith(f"{tmp_path / 'base' / 'base.yaml'}:8: training.max_stepz")


def test_extends_cycle_and_missing_base(write):
    a = write("a.yaml", "extends: b.yaml\n")
    write("b.yaml", "extends: a.yaml\n")
    b = a.parent / "b.yaml"
    assert problems(a) == [f"{b}: extends: loop: {a} -> {b} -> {a}"]
    c = write("c.yaml", "extends: nope.yaml\n")
    assert "nope.yaml: no such experiment file" in problems(c)[0]


def test_relative_paths_are_relative_to_the_yaml_file(write, tmp_path):
    (tmp_path / "d").mkdir()
    (tmp_path / "d" / "rows.jsonl").write_text('{"text": "a"}\n')
    path = write("exp.yaml", BASE.replace(f"{DATA}/sft_train.jsonl", "d/rows.jsonl"))
    assert load_experiment(path).data.train[0].path == str(tmp_path / "d" / "rows.jsonl")


def test_missing_files_and_required_fields(write):
    path = write("exp.yaml", "method: sft\nmodel:\n  name_or_path: ./nope\n"
                             "data:\n  train: missing.jsonl\n")
    found = problems(path)
    # named where it was looked for: next to the YAML file
    assert any(f"data.train[0].path: no such file or directory: {path.parent / 'missing.jsonl'}"
               in p for p in found), found
    assert any("model.name_or_path: no such model directory" in p for p in found)
    path = write("exp2.yaml", "method: sft\ndata:\n  train: x\n")
    assert problems(path) == [f"{path}: model: required, but missing"]


def test_yaml_syntax_error_and_duplicate_keys(write):
    path = write("bad.yaml", "method: sft\nmodel: [unclosed\n")
    [problem] = problems(path)
    assert problem.startswith(f"{path}:3:") and "YAML syntax error" in problem
    path = write("dup.yaml", BASE + "method: dpo\n")
    assert problems(path) == [f"{path}:7: method: duplicate key"]


def test_hub_ids_validate_without_network(write, online):
    path = write("hub.yaml", "method: sft\nmodel:\n  name_or_path: Qwen/Qwen2.5-0.5B-Instruct\n"
                             "data:\n  train: trl-lib/Capybara\n")
    exp = load_experiment(path)
    assert exp.model.name_or_path == "Qwen/Qwen2.5-0.5B-Instruct"
    assert exp.data.train[0].path == "trl-lib/Capybara"


def test_secrets_are_redacted_in_the_resolved_file(write):
    exp = load_experiment(write("exp.yaml", BASE + "training:\n  hub_token: hf_SECRET123\n"))
    assert exp.training["hub_token"] == "hf_SECRET123"
    text = resolved_yaml(exp)
    assert "hf_SECRET123" not in text and "hub_token: <redacted>" in text


def test_trust_remote_code_is_off_by_default(write):
    assert load_experiment(write("exp.yaml", BASE)).model.trust_remote_code is False


def test_the_resolved_experiment_validates_to_the_same_experiment(write, tmp_path):
    """Every rank reads the resolved file back: it must mean exactly the same."""
    exp = load_experiment(write("exp.yaml", BASE + textwrap.dedent("""\
        peft: {type: lora, r: 8}
        distributed: {strategy: deepspeed, num_processes: 2, deepspeed: {zero_stage: 3}}
        training: {max_steps: 4, learning_rate: 1e-3}
        """)))
    again = load_experiment(write("resolved/experiment.yaml", resolved_yaml(exp)))
    assert again.model_dump() == exp.model_dump()


def test_override_paths_are_relative_to_the_current_directory(write, tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "rows.jsonl").write_text('{"text": "a"}\n')
    path = write("exp.yaml", BASE)
    monkeypatch.chdir(tmp_path / "here")
    exp = load_experiment(path, ["data.train=rows.jsonl", "data.eval={path: ./rows.jsonl}"])
    assert exp.data.train[0].path == str(tmp_path / "here" / "rows.jsonl")
    assert exp.data.eval[0].path == str(tmp_path / "here" / "rows.jsonl")


@pytest.mark.parametrize("attn, device, padding_free", [
    ("auto", "cpu", True),            # finetune_varlen's reference kernel, no mask
    ("sdpa", "cpu", False),           # a dense (tokens x tokens) mask
    ("sdpa", "cuda", False),
    ("finetune_varlen", "cuda", True),
    ("flash_attention_2", "cuda", True),
])
def test_padding_free_by_default_only_where_it_is_fast(write, attn, device, padding_free):
    from finetune.config.derived.effective import arguments

    def experiment(*overrides):
        # validate refuses flash_attention_2 where flash_attn is missing (as here, on CPU)
        exp = load_experiment(write("exp.yaml", BASE), overrides)
        model = exp.model.model_copy(update={"attn_implementation": attn})
        return exp.model_copy(update={"model": model})

    exp = experiment()
    precision = "bf16" if device == "cuda" else "fp32"
    kwargs = arguments(exp, device, precision)
    assert kwargs.get("padding_free", False) is padding_free
    explicit = experiment("training.padding_free=true")
    assert arguments(explicit, device, precision)["padding_free"] is True
