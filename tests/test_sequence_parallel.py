"""Sequence parallelism on CPU (gloo), measured: `finetune launch` with
distributed.sequence_parallel 2 (DeepSpeed ALST/Ulysses over 2 processes: each row cut
in two halves whose attention is computed together) trains as 1 process on the same
global batch does (fp32, plain SGD without clipping, so a wrong gradient scale would
show: the same losses and weights within 1e-5), its final/ is a model transformers
loads, and a run stopped by SIGTERM mid-epoch resumes bitwise-identically."""

from __future__ import annotations

import json
import random

import pytest

from conftest import TINY_MODEL, free_port, run_cli
from resumable import Run, assert_continues, final_weights, losses

pytestmark = pytest.mark.slow  # training runs on 2 processes

STEPS = 12
WORDS = "apple rose yak tree goat sun van fish zebra kite wolf egg pen queen".split()


def long_rows(path) -> None:
    """Text rows of 30-40 tokens: with max_length 48 both halves of a row hold tokens."""
    rng = random.Random(0)
    path.write_text("".join(json.dumps({"text": " ".join(rng.choices(WORDS, k=rng.randint(
        14, 22)))}) + "\n" for _ in range(24)))


def experiment(name: str, data, sequence_parallel: int) -> str:
    distributed = ("distributed: {strategy: deepspeed, deepspeed: {zero_stage: 1}, "
                   "sequence_parallel: 2, num_processes: 2, device: cpu, "
                   f"main_process_port: {free_port()}}}\n" if sequence_parallel > 1 else "")
    return (f"name: {name}\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {{path: {data}}}\n{distributed}"
            "evaluation: {before_training: false}\noutput: {plot: false}\n"
            f"training: {{max_steps: {STEPS}, per_device_train_batch_size: 4, "
            "learning_rate: 0.05, optim: sgd, max_grad_norm: 1.0e+9, logging_steps: 1, "
            "save_steps: 4, seed: 5, max_length: 48, activation_checkpointing: false}\n")


def test_sequence_parallel_matches_one_process_and_resumes_exactly(write, tmp_path):
    """Over 60 s: three runs in one test (one process; an uninterrupted 2-process reference;
    a run resumed from its checkpoint), two of them `finetune launch`es whose two ranks
    each import torch and TRL cold. Split, each part would train the reference again."""
    data = tmp_path / "long.jsonl"
    long_rows(data)
    one = write("one.yaml", experiment("one", data, 1))
    assert Run("train", one, tmp_path, 0).wait() == 0
    reference = write("spref.yaml", experiment("spref", data, 2))
    first = Run("launch", reference, tmp_path, 0)
    assert first.wait() == 0, first.text()[-3000:]
    text = first.text()
    assert "layout     2 processes = data parallel 1 x sequence parallel 2" in text
    assert "4 per device x 1 accumulation x 1 data parallel group(s) = 4 effective" in text

    # Equivalence with one process: the same rows in each step, all of them in fp32.
    runs = tmp_path / "runs"
    single, parallel = losses(runs / "one"), losses(runs / "spref")
    assert len(single) == STEPS and [s[0] for s in single] == [p[0] for p in parallel]
    assert max(abs(s[1] - p[1]) for s, p in zip(single, parallel)) < 1e-5, (single, parallel)
    assert max(abs(s[2] - p[2]) for s, p in zip(single, parallel)) < 1e-4  # grad norms
    a, b = final_weights(runs / "one"), final_weights(runs / "spref")
    assert set(a) <= set(b)  # ZeRO may also write the tied lm_head
    assert max((a[k] - b[k]).abs().max().item() for k in a) < 1e-5

    from transformers import AutoModelForCausalLM

    AutoModelForCausalLM.from_pretrained(runs / "spref" / "final")

    # Resumed from the reference's checkpoint-4, mid-epoch (6 steps an epoch), into the
    # next epoch: the same run bitwise (the skipped batches, and the second epoch's shuffle).
    config = write("sp.yaml", experiment("sp", data, 2)
                   + f"resume: {runs}/spref/checkpoints/checkpoint-4\n")
    second = Run("launch", config, tmp_path, 2)
    assert second.wait() == 0, second.text()[-3000:]
    assert f"resuming from {runs}/spref/checkpoints/checkpoint-4" in second.text()
    assert_continues(runs / "sp", runs / "spref", 4, "sequence parallel resume")


def test_validate_refuses_sequence_parallel_without_deepspeed(write, tmp_path):
    path = write("ddp.yaml", experiment("ddp", tmp_path / "x.jsonl", 2).replace(
        "strategy: deepspeed, deepspeed: {zero_stage: 1}", "strategy: ddp"))
    (tmp_path / "x.jsonl").write_text('{"text": "a b"}\n')
    result = run_cli("validate", str(path), cwd=tmp_path)
    assert result.returncode == 2
    assert "ddp.yaml:6: distributed.sequence_parallel: needs strategy deepspeed" in result.stderr
    assert "Traceback" not in result.stderr
