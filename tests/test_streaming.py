"""data.streaming: sft on text rows read lazily, tokenized and packed as training goes.
Real runs of the CLI: a streamed run trains (its held-out loss falls), a SIGTERM/resume
chain over a weighted mixture that wraps around several times ends bitwise identical to
an uninterrupted run, and 2 processes match 1 process with the same global batch.
validate refuses what a stream cannot do, naming the YAML path, and its data pass reads
the streamed files as it reads any."""

from __future__ import annotations

import json
import random
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from conftest import DATA, TINY_MODEL, free_port, run_cli
from resumable import Run, assert_identical, losses, stopped_by_sigterm

WORDS = "the a cat dog sat on mat ran far over under big small red tree house river".split()


def text_file(path: Path, rows: int, seed: int, words: list[str] = WORDS) -> Path:
    rng = random.Random(seed)
    with path.open("w") as handle:
        for _ in range(rows):
            line = " ".join(rng.choice(words) for _ in range(rng.randint(4, 30)))
            handle.write(json.dumps({"text": line}) + "\n")
    return path


def streamed(name: str, train: str, *, steps: int, extra_data: str = "", extra: str = "",
             distributed: str = "", batch: int = 4) -> str:
    return (f"name: {name}\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {train}\n  streaming: true\n{extra_data}"
            f"{distributed}evaluation: {{before_training: false}}\noutput: {{plot: false}}\n"
            f"training:\n  max_steps: {steps}\n  packing: true\n  max_length: 64\n"
            f"  per_device_train_batch_size: {batch}\n  learning_rate: 1e-3\n"
            "  logging_steps: 1\n  save_steps: 4\n  seed: 5\n  activation_checkpointing: false\n"
            + extra)


def errors(result) -> list[str]:
    return [line for line in result.stderr.splitlines() if line.startswith("error:")]


@pytest.mark.parametrize("change,expected", [
    ({"training": "max_steps"}, "data.streaming: needs training.max_steps"),
    ({"method": "reward"}, "data.streaming: streams text rows (continued pretraining), for method sft"),
    ({"eval_fraction": 0.1}, "data.eval_fraction: not with data.streaming"),
    ({"max_samples": 10}, "data.train[0].max_samples: not with data.streaming"),
    ({"training": "packing"}, "data.streaming: needs training.packing: true"),
])
def test_validate_refuses_what_a_stream_cannot_do(change, expected, write, tmp_path):
    text = streamed("v", f"{{path: {DATA}/sft_train.jsonl}}", steps=10)
    if change.get("training"):
        text = "\n".join(line for line in text.splitlines()
                         if not line.strip().startswith(change["training"] + ":")) + "\n"
    if "method" in change:  # a reward run: its own training keys only
        text = text.replace("method: sft", f"method: {change['method']}").replace(
            "  packing: true\n", "")
    if "eval_fraction" in change:
        text = text.replace("  streaming: true\n",
                            f"  streaming: true\n  eval_fraction: {change['eval_fraction']}\n")
    if "max_samples" in change:
        text = text.replace("sft_train.jsonl}", f"sft_train.jsonl, max_samples: "
                                                f"{change['max_samples']}}}")
    result = run_cli("validate", str(write("v.yaml", text)), "--no-data", cwd=tmp_path)
    assert result.returncode == 2, result.stdout + result.stderr
    assert any(expected in line for line in errors(result)), result.stderr


@pytest.mark.slow
def test_validate_reads_streamed_files(write, tmp_path):
    """The data pass checks a streamed file row by row (a bad row deep in it), and refuses
    rows that are not text, as training's stream would."""
    bad = text_file(tmp_path / "bad.jsonl", 300, seed=1)
    lines = bad.read_text().splitlines()
    lines[256] = json.dumps({"text": 7})
    bad.write_text("\n".join(lines) + "\n")
    result = run_cli("validate", str(write("b.yaml", streamed("b", str(bad), steps=5))),
                     cwd=tmp_path)
    assert result.returncode == 2
    assert f"{bad} line 257" in result.stderr, result.stderr

    chat = streamed("c", f"{{path: {DATA}/sft_train.jsonl}}", steps=5)
    result = run_cli("validate", str(write("c.yaml", chat)), cwd=tmp_path)
    assert result.returncode == 2
    assert "is format messages; data.streaming streams text rows" in result.stderr, \
        result.stderr

    good = text_file(tmp_path / "good.jsonl", 300, seed=2)
    result = run_cli("validate", str(write("g.yaml", streamed("g", str(good), steps=5))),
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert "300 rows, format text" in result.stdout + result.stderr


@pytest.mark.slow
def test_a_streamed_run_trains_and_its_eval_loss_falls(write, tmp_path):
    train = text_file(tmp_path / "train.jsonl", 5000, seed=3)
    held = text_file(tmp_path / "eval.jsonl", 40, seed=4)
    config = write("s.yaml", streamed("s", str(train), steps=40,
                                      extra_data=f"  eval: {held}\n").replace(
        "before_training: false", "before_training: true"))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "streamed train blocks of 64 tokens" in result.stdout
    summary = json.loads((tmp_path / "runs" / "s" / "summary.json").read_text())
    assert summary["global_step"] == 40
    before, after = summary["before"]["eval_loss"], summary["after"]["eval_loss"]
    assert after < before - 1.0, (before, after)
    assert not (tmp_path / "runs" / ".data-cache").exists()  # a stream is never cached


@pytest.mark.slow
def test_sigterm_then_resume_of_a_stream_is_bitwise_identical(write, tmp_path):
    """Two weighted sources, small enough that the stream wraps around several times
    before the stop: the resumed run re-reads the stream to its step and goes on exactly."""
    a = text_file(tmp_path / "a.jsonl", 40, seed=5)
    b = text_file(tmp_path / "b.jsonl", 25, seed=6, words=["x", "y", "z", "w"])
    train = f"\n    - {{path: {a}, weight: 3}}\n    - {{path: {b}, weight: 1}}"
    reference = write("ref.yaml", streamed("ref", train, steps=28))
    whole = Run("train", reference, tmp_path, 0)
    assert whole.wait() == 0, whole.text()[-3000:]

    config = write("cut.yaml", streamed("cut", train, steps=28))
    run_dir = tmp_path / "runs" / "cut"
    first = stopped_by_sigterm("train", config, run_dir, tmp_path, random.randint(13, 18))
    resumed = Run("train", config, tmp_path, 2)
    assert resumed.wait() == 0, resumed.text()[-3000:]
    assert "resuming from" in resumed.text()
    assert "received SIGTERM" in first.text()
    assert_identical(run_dir, tmp_path / "runs" / "ref", "streamed resume")
    assert [s for s, *_ in losses(run_dir)] == list(range(1, 29))


@pytest.mark.slow
def test_two_processes_match_one_with_the_same_global_batch(write, tmp_path):
    train = text_file(tmp_path / "t.jsonl", 200, seed=7)
    sgd = ("  optim: sgd\n  lr_scheduler_type: constant\n  weight_decay: 0.0\n"
           "  max_grad_norm: 0.0\n")
    weights = {}
    for name, processes, batch in (("one", 1, 4), ("two", 2, 2)):
        distributed = (f"distributed: {{strategy: ddp, num_processes: 2, device: cpu, "
                       f"main_process_port: {free_port()}}}\n" if processes > 1 else "")
        text = streamed(name, str(train), steps=4, distributed=distributed, batch=batch,
                        extra=sgd).replace("learning_rate: 1e-3", "learning_rate: 0.1")
        result = run_cli("launch" if processes > 1 else "train", str(write(f"{name}.yaml", text)),
                         cwd=tmp_path)
        assert result.returncode == 0, result.stderr[-3000:]
        weights[name] = load_file(tmp_path / "runs" / name / "final" / "model.safetensors")
    init = load_file(tmp_path / "runs" / "one" / "init-model" / "model.safetensors")
    worst = 0.0
    for key, ref in weights["one"].items():
        update = ref - init[key]
        if update.norm() > 0:
            worst = max(worst, ((weights["two"][key] - ref).norm() / update.norm()).item())
    print(f"2 processes x 2 vs 1 x 4: update rel. diff {worst:.2e}")
    assert worst <= 1e-3, worst
