"""Tensor parallelism on CPU (gloo), measured: `finetune launch` with
distributed.tensor_parallel 2 (DeepSpeed AutoTP over 2 processes: one data parallel group)
trains as 1 process on the same global batch does (fp32: the same logged losses, weights
within 1e-6), its final/ is a whole model that transformers loads (plain tensors, no
shards), and a run stopped by SIGTERM resumes bitwise-identically."""

from __future__ import annotations

import json

import pytest
import torch

from conftest import DATA, TINY_MODEL, free_port, run_cli
from resumable import Run, assert_continues, final_weights, losses

pytestmark = pytest.mark.slow  # training runs on 2 processes

STEPS = 12


def experiment(name: str, tensor_parallel: int) -> str:
    distributed = ("distributed: {strategy: deepspeed, deepspeed: {zero_stage: 1}, "
                   "tensor_parallel: 2, num_processes: 2, device: cpu, "
                   f"main_process_port: {free_port()}}}\n" if tensor_parallel > 1 else "")
    return (f"name: {name}\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 16}}\n{distributed}"
            "evaluation: {before_training: false}\noutput: {plot: false}\n"
            f"training: {{max_steps: {STEPS}, per_device_train_batch_size: 4, "
            "learning_rate: 0.05, optim: sgd, logging_steps: 1, save_steps: 4, seed: 5, "
            "max_length: 64, activation_checkpointing: false}\n")


def test_tensor_parallel_matches_one_process_and_resumes_exactly(write, tmp_path):
    """Over 60 s: three runs in one test (one process; an uninterrupted 2-process reference;
    a run resumed from its checkpoint), two of them `finetune launch`es whose two ranks
    each import torch and TRL cold. Split, each part would train the reference again."""
    one = write("one.yaml", experiment("one", 1))
    assert Run("train", one, tmp_path, 0).wait() == 0
    reference = write("tpref.yaml", experiment("tpref", 2))
    first = Run("launch", reference, tmp_path, 0)
    assert first.wait() == 0, first.text()[-3000:]
    assert "layout     2 processes = data parallel 1 x tensor parallel 2" in first.text()
    runs = tmp_path / "runs"
    rendered = json.loads((runs / "tpref" / "deepspeed.json").read_text())
    assert rendered["tensor_parallel"]["autotp_size"] == 2

    # Equivalence with one process: the same rows in each step, all of them in fp32.
    single, parallel = losses(runs / "one"), losses(runs / "tpref")
    assert len(single) == STEPS and [s[0] for s in single] == [p[0] for p in parallel]
    assert max(abs(s[1] - p[1]) for s, p in zip(single, parallel)) < 1e-5, (single, parallel)
    a, b = final_weights(runs / "one"), final_weights(runs / "tpref")
    start = final_weights_of(runs / "one" / "init-model")
    assert a.keys() == b.keys()
    assert max((a[k] - start[k]).abs().max().item() for k in a) > 1e-3  # it trained
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5

    # final/ is a normal model: whole tensors of the configured shapes.
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(runs / "tpref" / "final")
    weight = model.model.layers[0].self_attn.q_proj.weight
    assert type(weight) is torch.nn.Parameter and tuple(weight.shape) == (128, 128)

    # Resumed from the reference's checkpoint-4 (its AutoTP shards): the same run bitwise.
    config = write("tp.yaml", experiment("tp", 2)
                   + f"resume: {runs}/tpref/checkpoints/checkpoint-4\n")
    second = Run("launch", config, tmp_path, 2)
    assert second.wait() == 0, second.text()[-3000:]
    assert f"resuming from {runs}/tpref/checkpoints/checkpoint-4" in second.text()
    assert_continues(runs / "tp", runs / "tpref", 4, "tensor parallel resume")


def final_weights_of(directory):
    from safetensors.torch import load_file

    return load_file(directory / "model.safetensors")


def test_validate_refuses_tensor_parallel_without_deepspeed(write, tmp_path):
    path = write("ddp.yaml", experiment("ddp", 2).replace(
        "strategy: deepspeed, deepspeed: {zero_stage: 1}", "strategy: ddp"))
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert "ddp.yaml:6: distributed.tensor_parallel: needs strategy deepspeed" in result.stderr
    assert "Traceback" not in result.stderr
