"""distributed.tensor_parallel (DeepSpeed AutoTP): what validate refuses, each naming the
YAML path and why, and the DeepSpeed config that carries it (generated, or hand-written
and checked). Trained for real in tests/test_tensor_parallel.py."""

from __future__ import annotations

import json

import pytest

from config_errors import problems
from conftest import DATA, TINY_MODEL
from finetune.config import load_experiment
from finetune.config.deepspeed import deepspeed_dict

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
