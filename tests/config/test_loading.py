"""Experiment loading: schema, errors with YAML paths and lines, extends, overrides, rules."""

from __future__ import annotations

import textwrap

import pytest
import yaml

from conftest import MINIMAL_SFT as BASE, DATA, TINY_MODEL
from finetune.config import load_experiment
from finetune.errors import ConfigError
from finetune.render.bundle import resolved_yaml



def problems(path, *overrides):
    with pytest.raises(ConfigError) as info:
        load_experiment(path, overrides)
    return info.value.problems


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
    assert "extends: cycle" in problems(a)[0]
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
    assert any("data.train[0].path: no such file: missing.jsonl" in p for p in found)
    assert any("model.name_or_path: no such model directory" in p for p in found)
    path = write("exp2.yaml", "method: sft\ndata:\n  train: x\n")
    assert problems(path) == [f"{path}: model: required, but missing"]


def test_yaml_syntax_error_and_duplicate_keys(write):
    path = write("bad.yaml", "method: sft\nmodel: [unclosed\n")
    [problem] = problems(path)
    assert problem.startswith(f"{path}:3:") and "YAML syntax error" in problem
    path = write("dup.yaml", BASE + "method: dpo\n")
    assert problems(path) == [f"{path}:7: method: duplicate key"]


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


def test_distributed_rules(write):
    def found(distributed: str) -> str:
        return "\n".join(problems(write("d.yaml", BASE + f"distributed: {distributed}\n")))

    # strategy none over 2 processes is DDP (launch/environment.parallel_note), not an error.
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


def test_override_paths_are_relative_to_the_current_directory(write, tmp_path, monkeypatch):
    (tmp_path / "here").mkdir()
    (tmp_path / "here" / "rows.jsonl").write_text('{"text": "a"}\n')
    path = write("exp.yaml", BASE)
    monkeypatch.chdir(tmp_path / "here")
    exp = load_experiment(path, ["data.train=rows.jsonl", "data.eval={path: ./rows.jsonl}"])
    assert exp.data.train[0].path == str(tmp_path / "here" / "rows.jsonl")
    assert exp.data.eval[0].path == str(tmp_path / "here" / "rows.jsonl")


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


def test_attention_accepts_what_transformers_accepts(write):
    # flash_attention_3 and hub kernels need packages: tests/test_hostile_config.py
    for name in ("flex_attention", "finetune_varlen", "eager"):
        exp = load_experiment(write("exp.yaml", BASE), [f"model.attn_implementation={name}"])
        assert exp.model.attn_implementation == name
    path = write("exp.yaml", BASE.replace("init: random\n",
                                          "init: random\n  attn_implementation: flash_attn2\n"))
    [problem] = problems(path)
    assert problem.startswith(f"{path}:5: model.attn_implementation: 'flash_attn2' is not an "
                              "attention implementation: use one of auto, finetune_varlen")


@pytest.mark.parametrize("attn, device, padding_free", [
    ("auto", "cpu", True),            # finetune_varlen's reference kernel, no mask
    ("sdpa", "cpu", False),           # a dense (tokens x tokens) mask
    ("sdpa", "cuda", False),
    ("finetune_varlen", "cuda", True),
    ("flash_attention_2", "cuda", True),
])
def test_padding_free_by_default_only_where_it_is_fast(write, attn, device, padding_free):
    from finetune.render.training_args import training_kwargs

    def experiment(*overrides):
        # validate refuses flash_attention_2 where flash_attn is missing (as here, on CPU)
        exp = load_experiment(write("exp.yaml", BASE), overrides)
        model = exp.model.model_copy(update={"attn_implementation": attn})
        return exp.model_copy(update={"model": model})

    exp = experiment()
    precision = "bf16" if device == "cuda" else "fp32"
    kwargs = training_kwargs(exp, write("run/x", "").parent, device, precision)
    assert kwargs.get("padding_free", False) is padding_free
    explicit = experiment("training.padding_free=true")
    assert training_kwargs(explicit, write("run/x", "").parent, device,
                           precision)["padding_free"] is True
