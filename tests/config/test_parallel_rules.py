"""distributed.tensor_parallel (DeepSpeed AutoTP): what validate refuses, each naming the
YAML path and why, and the DeepSpeed config that carries it (generated, or hand-written
and checked). Trained for real in tests/test_tensor_parallel.py."""

from __future__ import annotations

import json

import pytest

from config_errors import problems
from conftest import DATA, TINY_MODEL
from finetune.config import load_experiment
from finetune.config.derived.deepspeed import deepspeed_dict

TP = ("distributed.strategy=deepspeed", "distributed.num_processes=2",
      "distributed.tensor_parallel=2")


def sft(write, extra: str = ""):
    return write("exp.yaml", f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
                             f"data:\n  train: {{path: {DATA}/sft_train.jsonl}}\n{extra}")


def test_a_valid_layout_carries_autotp_into_the_deepspeed_config(write):
    experiment = load_experiment(sft(write), TP)
    assert experiment.distributed.data_parallel == 1
    config = deepspeed_dict(experiment)
    assert config["tensor_parallel"] == {"autotp_size": 2, "vocab_parallel_lm_head": False}
    assert config["zero_optimization"]["stage3_gather_16bit_weights_on_model_save"] is True
    plain = deepspeed_dict(load_experiment(sft(write), TP[:2]))
    assert "tensor_parallel" not in plain


@pytest.mark.parametrize("overrides,expected", [
    (("distributed.strategy=ddp",), "distributed.tensor_parallel: needs strategy deepspeed"),
    (("distributed.strategy=fsdp",), "DistributedType.MULTI_CPU"),
    (("distributed.num_processes=3",), "distributed.tensor_parallel: 3 processes are not a "
                                       "multiple of tensor_parallel 2"),
    (("distributed.num_processes=4", "distributed.num_machines=2",
      "distributed.tensor_parallel=4"), "distributed.tensor_parallel: 4 does not divide the 2 "
                                        "processes of a machine"),
    (("distributed.num_processes=3", "distributed.tensor_parallel=3"),
     "distributed.tensor_parallel: 3 does not divide the model's num_attention_heads (4)"),
    (("distributed.deepspeed.zero_stage=3",), "distributed.deepspeed.zero_stage: 3 with "
                                              "tensor_parallel is not verified"),
    (("peft.type=lora",), "peft.type: lora with tensor_parallel is not verified"),
])
def test_what_tensor_parallel_refuses(write, overrides, expected):
    found = "\n".join(problems(sft(write), *TP, *overrides))
    assert expected in found, found


def test_without_a_process_count_the_launchers_is_checked_when_taken(write):
    path = sft(write, "distributed: {strategy: deepspeed, tensor_parallel: 2}\n")
    assert load_experiment(path).distributed.tensor_parallel == 2  # no count: not yet known
    found = "\n".join(problems(path, "distributed.num_processes=3"))  # the launcher's 3
    assert "3 processes are not a multiple of tensor_parallel 2" in found


def test_methods_other_than_sft_are_refused(write):
    path = write("dpo.yaml", f"method: dpo\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
                             f"data:\n  train: {{path: {DATA}/pref_train.jsonl}}\n")
    found = "\n".join(problems(path, *TP))
    assert "method: dpo with tensor_parallel is not verified" in found, found


def test_a_hand_written_deepspeed_file_must_agree(write, tmp_path):
    mine = tmp_path / "mine.json"
    mine.write_text(json.dumps({"zero_optimization": {"stage": 1}}))
    found = "\n".join(problems(sft(write), *TP, f"distributed.deepspeed.config_file={mine}",
                               "distributed.deepspeed.zero_stage=1"))
    assert "tensor_parallel.autotp_size is 1, but the experiment's " \
           "distributed.tensor_parallel is 2" in found, found
    assert "stage3_gather_16bit_weights_on_model_save: true" in found
    mine.write_text(json.dumps({"zero_optimization": {
        "stage": 1, "stage3_gather_16bit_weights_on_model_save": True},
        "tensor_parallel": {"autotp_size": 2}}))
    load_experiment(sft(write), TP + (f"distributed.deepspeed.config_file={mine}",
                                      "distributed.deepspeed.zero_stage=1"))
    found = "\n".join(problems(sft(write), TP[0], TP[1],
                               f"distributed.deepspeed.config_file={mine}",
                               "distributed.deepspeed.zero_stage=1"))
    assert "autotp_size is 2, but the experiment's distributed.tensor_parallel is 1" in found


# ---- distributed.sequence_parallel (DeepSpeed ALST/Ulysses; trained in
# tests/test_sequence_parallel.py) ----

SP = ("distributed.strategy=deepspeed", "distributed.num_processes=2",
      "distributed.sequence_parallel=2")


def test_a_valid_sequence_parallel_layout(write):
    from finetune.config.derived.effective import arguments, flattens

    experiment = load_experiment(sft(write), SP + ("training.max_length=47",))
    assert experiment.distributed.data_parallel == 1
    assert not flattens(experiment)  # padded rows: Ulysses drops the attention mask
    kwargs = arguments(experiment, "cpu", "fp32")
    assert kwargs["pad_to_multiple_of"] == 48 and "padding_free" not in kwargs
    four = load_experiment(sft(write), SP + ("distributed.num_processes=4",))
    assert four.distributed.data_parallel == 2


@pytest.mark.parametrize("overrides,expected", [
    (("distributed.strategy=ddp",), "distributed.sequence_parallel: needs strategy deepspeed"),
    (("distributed.num_processes=3",), "distributed.sequence_parallel: 3 processes are not a "
                                       "multiple of sequence_parallel 2"),
    (("distributed.num_processes=4", "distributed.tensor_parallel=2"),
     "distributed.sequence_parallel: with tensor_parallel does not run"),
    (("distributed.num_processes=3", "distributed.sequence_parallel=3"),
     "distributed.sequence_parallel: 3 does not divide the model's num_attention_heads (4)"),
    (("distributed.deepspeed.zero_stage=0",), "distributed.deepspeed.zero_stage: 0 with "
                                              "sequence_parallel: not verified"),
    (("distributed.deepspeed.zero_stage=3",), "distributed.deepspeed.zero_stage: 3 with "
                                              "sequence_parallel: measured on CPU"),
    (("peft.type=lora",), "peft.type: lora with sequence_parallel: measured on CPU"),
    (("model.attn_implementation=eager",), "model.attn_implementation: eager cannot run "
                                           "under sequence_parallel"),
    (("model.attn_implementation=finetune_varlen",), "finetune_varlen is not one it knows"),
    (("training.padding_free=true",), "training.padding_free: not supported with "
                                      "sequence_parallel: Ulysses drops the attention mask"),
    (("training.packing=true",), "training.packing: not supported with sequence_parallel"),
    (("training.pad_to_multiple_of=8",), "training.pad_to_multiple_of: is finetune's"),
    (("training.loss_type=dft",), "training.loss_type: dft is refused by TRL"),
    (("data.weight_column=w",), "data.weight_column: not supported with sequence_parallel"),
])
def test_what_sequence_parallel_refuses(write, overrides, expected):
    found = "\n".join(problems(sft(write), *SP, *overrides))
    assert expected in found, found


def test_sequence_parallel_refuses_methods_other_than_sft(write):
    path = write("dpo.yaml", f"method: dpo\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
                             f"data:\n  train: {{path: {DATA}/pref_train.jsonl}}\n")
    found = "\n".join(problems(path, *SP))
    assert "method: dpo with sequence_parallel is not verified" in found, found


def test_a_rank_refuses_an_accelerate_file_that_says_another_sequence_parallel(write):
    from finetune.run.launched import launch_problems

    experiment = load_experiment(sft(write), SP)
    env = {"WORLD_SIZE": "2", "ACCELERATE_USE_PARALLELISM_CONFIG": "true",
           "PARALLELISM_CONFIG_SP_SIZE": "2", "PARALLELISM_CONFIG_CP_SIZE": "1"}
    assert launch_problems(experiment, env, "fp32") == []
    found = "\n".join(launch_problems(experiment, {**env, "PARALLELISM_CONFIG_SP_SIZE": "4"},
                                      "fp32"))
    assert "parallelism_config_sp_size 4, but the experiment's is 2" in found, found


# ---- distributed.context_parallel (accelerate's torch context parallelism, GPU only; its
# Accelerate file is checked in tests/test_context_parallel.py) ----

def cp_experiment(extra: str = "") -> str:
    return (f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random, "
            "attn_implementation: sdpa}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 4}}\n"
            "distributed: {strategy: fsdp, num_processes: 4, device: cuda, "
            f"main_process_port: 29745, context_parallel: 2{extra}}}\n")


def test_a_valid_context_parallel_layout(write):
    from finetune.config.derived.effective import arguments, flattens
    from finetune.render.accelerate import accelerate_config

    experiment = load_experiment(write("exp.yaml", cp_experiment()))
    assert experiment.distributed.data_parallel == 2 and not flattens(experiment)
    assert arguments(experiment, "cuda", "bf16")["pad_to_multiple_of"] == 4
    assert accelerate_config(experiment, None)["parallelism_config"] == {
        "parallelism_config_dp_replicate_size": 1, "parallelism_config_dp_shard_size": 2,
        "parallelism_config_tp_size": 1, "parallelism_config_cp_size": 2,
        "parallelism_config_cp_backend": "torch",
        "parallelism_config_cp_comm_strategy": "allgather"}


@pytest.mark.parametrize("extra,expected", [
    (", fsdp: {version: 1}", "distributed.context_parallel: needs strategy fsdp with "
                             "fsdp.version 2"),
    (", sequence_parallel: 2", "Context Parallelism (CP) and Sequence Parallelism (SP) are "
                               "mutually exclusive"),
    (", num_processes: 3", "3 processes are not a multiple of context_parallel 2"),
    (", device: cpu", "distributed.strategy: fsdp needs CUDA devices"),
])
def test_what_context_parallel_refuses(write, extra, expected):
    text = cp_experiment().replace("num_processes: 4, device: cuda, ", "").replace(
        "context_parallel: 2", "context_parallel: 2" + extra)
    if "num_processes" not in extra:
        text = text.replace("strategy: fsdp,", "strategy: fsdp, num_processes: 4,")
    if "device" not in extra:
        text = text.replace("strategy: fsdp,", "strategy: fsdp, device: cuda,")
    found = "\n".join(problems(write("exp.yaml", text)))
    assert expected in found, found


def test_context_parallel_needs_sdpa_and_padded_rows(write):
    path = write("exp.yaml", cp_experiment().replace(", attn_implementation: sdpa", ""))
    found = "\n".join(problems(path, "training.padding_free=true", "peft.type=lora"))
    assert "model.attn_implementation: must be sdpa with context_parallel" in found, found
    assert "training.padding_free: not supported with context_parallel" in found
    assert "peft.type: lora with context_parallel is not verified" in found
