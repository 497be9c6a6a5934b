"""method distill (TRL's DistillationTrainer): validation of distill.teacher naming its
YAML path, end-to-end runs with full fine-tuning, LoRA and QLoRA from a teacher that is a
model directory or a finetune run (full final/ or a LoRA adapter), the vocabulary check,
refused weights, and a learning test: the student's held-out KL toward the teacher falls;
a vision-language student from a vision-language teacher that sees the prompts' pictures,
and a teacher that would not see them (or would see pictures its student cannot) refused.
Exact resume and data parallelism are in test_resume.py and test_data_parallel.py."""

from __future__ import annotations

import json
import shutil

import pytest
import yaml

from conftest import DATA, QUICKSTART, REPO, TINY_MODEL, run_cli
from finetune.config.load import load_experiment
from finetune.errors import ConfigError, DataError
from teachers import held_out_kl, tiny_teacher, tiny_vlm_teacher

# One worker runs this module: its module fixture (teachers) trains once, not once per worker.
pytestmark = pytest.mark.xdist_group("distill")


def experiment(teacher, peft: str = "none", extra: str = "", steps: int = 3) -> str:
    peft_block = f"peft:\n  type: {peft}\n  r: 4\n" if peft != "none" else ""
    return (f"method: distill\nmodel:\n  name_or_path: {TINY_MODEL}\n  init: random\n"
            f"{peft_block}distill: {{teacher: {teacher}}}\n"
            f"data:\n  train: {{path: {DATA}/sft_train.jsonl, max_samples: 32}}\n"
            f"  eval: {{path: {DATA}/sft_eval.jsonl, max_samples: 8}}\n"
            f"output: {{plot: false}}\n"
            f"training:\n  max_steps: {steps}\n  per_device_train_batch_size: 8\n"
            "  logging_steps: 1\n  learning_rate: 1e-3\n  max_completion_length: 8\n"
            "  activation_checkpointing: false\n" + extra)


def _problems(write, text: str) -> str:
    try:
        load_experiment(write("d.yaml", text))
    except ConfigError as exc:
        return str(exc)
    return ""


def test_teacher_is_required_and_must_hold_a_model(write, tmp_path):
    without = experiment("x").replace("distill: {teacher: x}\n", "")
    assert "distill: method distill needs distill.teacher" in _problems(write, without)
    empty = tmp_path / "empty"
    empty.mkdir()
    assert f"distill.teacher: {empty} holds no model (neither config.json nor " \
           "adapter_config.json)" in _problems(write, experiment(empty))
    assert f"distill.teacher: no such model directory: {tmp_path}/gone" in \
        _problems(write, experiment(tmp_path / "gone"))
    unfinished = tmp_path / "runs" / "unfinished"
    unfinished.mkdir(parents=True)
    (unfinished / "experiment.yaml").write_text("method: sft\n")
    assert f"distill.teacher: {unfinished} is a run directory with no final/ model yet: " \
           "finish that run first" in _problems(write, experiment(unfinished))
    # distill.teacher belongs to method distill; training's teacher fields are finetune's
    assert "distill: options for methods distill and gkd, but method is sft" in _problems(
        write, experiment(TINY_MODEL).replace("method: distill", "method: sft")
        .replace("max_completion_length", "max_length"))
    assert "training.teacher_model_name_or_path: not set here: finetune sets it from " \
           "`distill.teacher`" in _problems(
               write, experiment(TINY_MODEL, extra="  teacher_model_name_or_path: x\n"))


def test_weights_are_refused_with_the_reason(write):
    text = experiment(TINY_MODEL).replace("max_samples: 32}", "max_samples: 32}\n"
                                          "  weight_column: w")
    assert "data.weight_column: not used by method distill: its trainer has no per-sample " \
           "loss weights" in _problems(write, text)


def test_example_config_validates(online, tmp_path):
    exp = load_experiment(REPO / "configs" / "examples" / "qwen2.5-0.5b-distill-lora.yaml")
    assert (exp.method, exp.distill.teacher, exp.peft.type) == (
        "distill", "Qwen/Qwen2.5-1.5B-Instruct", "lora")


@pytest.fixture(scope="module")
def teachers(tmp_path_factory):
    """finetune sft runs of the quickstart (a few seconds each): full and LoRA."""
    root = tmp_path_factory.mktemp("teachers")
    for name, peft in (("full", "none"), ("lora", "lora")):
        result = run_cli("train", str(QUICKSTART / "sft.yaml"), f"name={name}",
                         f"peft.type={peft}", "training.max_steps=40",
                         "training.learning_rate=3e-3", "evaluation.exact_match=false",
                         "evaluation.before_training=false", "output.plot=false", cwd=root)
        assert result.returncode == 0, result.stderr[-3000:]
    return root / "runs"


@pytest.mark.slow
@pytest.mark.parametrize("peft,teacher", [("none", "lora"), ("lora", "full"),
                                          ("qlora", "directory")])
def test_train_writes_a_complete_run_directory(peft, teacher, teachers, write, tmp_path):
    source = tiny_teacher(tmp_path / "teacher") if teacher == "directory" else teachers / teacher
    config = write(f"d-{peft}.yaml", experiment(source, peft))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / f"d-{peft}"
    resolved = yaml.safe_load((run / "experiment.yaml").read_text())
    assert resolved["distill"]["teacher"] == str(source)
    args = json.loads((run / "training_args.json").read_text())
    assert args["max_completion_length"] == 8 and args["beta"] == 1.0
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(isinstance(x, float) and x == x for x in losses)
    assert any("completions/mean_length" in r for r in records)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 3 and "eval_loss" in summary["after"]
    final = run / "final"
    assert (final / "tokenizer.json").exists()
    assert (final / ("model.safetensors" if peft == "none" else
                     "adapter_model.safetensors")).exists()
    if peft != "none":
        assert f"peft {peft}" in result.stdout
    assert "finetune: done in" in result.stdout


@pytest.mark.slow
def test_a_teacher_of_another_vocabulary_is_refused(write, tmp_path):
    other = tiny_teacher(tmp_path / "other", vocab_size=300)
    result = run_cli("train", str(write("v.yaml", experiment(other))), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "distill.teacher: the teacher's vocabulary has 300 entries (vocab_size), the " \
           "student's" in result.stderr


@pytest.mark.slow
def test_a_classifier_run_is_not_a_teacher(write, tmp_path):
    result = run_cli("train", str(QUICKSTART / "classify.yaml"), "name=cls",
                     "training.max_steps=2", "evaluation.before_training=false",
                     "output.plot=false", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    result = run_cli("train", str(write("c.yaml", experiment(tmp_path / "runs" / "cls"))),
                     cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
    assert "is a classify run: its model scores text" in result.stderr


@pytest.mark.slow
def test_the_student_learns_the_teacher(teachers, write, tmp_path):
    """Forward KL (beta 0), 60 steps from random weights: the held-out KL toward the
    teacher (on the teacher's own answers) and the eval loss both fall."""
    teacher = teachers / "full"
    config = write("learn.yaml", experiment(teacher, steps=60).replace(
        "max_samples: 32}", "max_samples: 2000}").replace("max_samples: 8}", "max_samples: 32}"))
    result = run_cli("train", str(config), "training.beta=0.0", "training.learning_rate=3e-3",
                     "training.per_device_train_batch_size=16",
                     "training.max_completion_length=12", "training.save_strategy='no'",
                     "training.seed=1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / "learn"
    summary = json.loads((run / "summary.json").read_text())
    before_loss, after_loss = summary["before"]["eval_loss"], summary["after"]["eval_loss"]
    before = held_out_kl(run / "init-model", teacher / "final")
    after = held_out_kl(run / "final", teacher / "final")
    print(f"held-out KL(teacher||student) {before:.3f} -> {after:.3f}; eval loss "
          f"{before_loss:.3f} -> {after_loss:.3f} in {summary['seconds']} s")
    assert after < 0.5 * before
    assert after_loss < 0.5 * before_loss


# ---- a vision-language student ----

TINY_VLM = QUICKSTART / "tiny-vlm"


def vlm_experiment(teacher, student=TINY_VLM) -> str:
    """distill of the tiny VLM on the quickstart's conversations with pictures (their
    prompts: a picture and a question)."""
    return (f"method: distill\nmodel:\n  name_or_path: {student}\n  init: random\n"
            f"distill: {{teacher: {teacher}}}\n"
            f"data:\n  train: {{path: {QUICKSTART}/data/vlm_train.jsonl, max_samples: 8}}\n"
            "output: {plot: false}\n"
            "training:\n  max_steps: 2\n  per_device_train_batch_size: 4\n"
            "  logging_steps: 1\n  max_completion_length: 4\n"
            "  activation_checkpointing: false\n")


def test_a_teacher_sees_pictures_exactly_when_its_student_does(write):
    """validate, for local models: a text teacher of a VLM student would score answers
    about pictures it never saw; a VLM teacher of a text student would see none."""
    assert f"distill.teacher: {TINY_MODEL} is a text model and the student a " \
           "vision-language one: it would score answers about pictures it cannot see" in \
        _problems(write, vlm_experiment(TINY_MODEL))
    assert f"distill.teacher: {TINY_VLM} is a vision-language model and the student a text " \
           "one" in _problems(write, experiment(TINY_VLM))
    assert _problems(write, vlm_experiment(TINY_VLM)) == ""


@pytest.mark.slow
def test_a_vlm_student_distills_from_a_vlm_teacher_that_sees_the_pictures(write, tmp_path):
    """Two steps through `finetune train` from the prompts of conversations with pictures,
    each prompt's tokens, its picture's 16 image tokens included, as finetune measures
    them when it drops prompts too long; then the trainer finetune builds, in process:
    the teacher's vision tower gets the very pixel values of the batch, and blanking them
    (a hook on the teacher's tower only) changes the distill loss. A text teacher is one
    line at training too (methods/teacher.py; validate: the test above), and so is one
    whose processor prepares pictures otherwise; the run just trained teaches."""
    import dataclasses

    import torch

    from finetune.methods import Job
    from finetune.methods.teacher import teacher_model
    from finetune.model.hardware import resolve_hardware
    from finetune.model.vision import chat_prompts
    from finetune.run.build import method_trainer, starting_model, tokenizer_and_data

    config = write("vlm.yaml", vlm_experiment(tiny_vlm_teacher(tmp_path / "teacher")))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    records = [json.loads(line) for line in
               (tmp_path / "runs" / "vlm" / "metrics.jsonl").read_text().splitlines()]
    steps = [r for r in records if "loss" in r]
    assert len(steps) == 2 and all(0 < r["loss"] < 10 for r in steps), steps
    # The two steps read the 8 prompts once: their tokens as the trainer counted them
    prompts = steps[1]["num_tokens"] - 4 * sum(r["completions/mean_length"] for r in steps)

    experiment = load_experiment(config)
    run_dir = tmp_path / "runs" / "in-process"  # beside the run: its prepared data shared
    run_dir.mkdir()
    hw = resolve_hardware(experiment)
    processor, data = tokenizer_and_data(experiment, run_dir)
    args, model = starting_model(experiment, hw, processor, run_dir, 0, run_dir, None)
    job = Job(experiment=experiment, run_dir=run_dir, hardware=hw, tokenizer=processor,
              model=model, data=data, args=args)
    # ... are those finetune measures a prompt by (vision_lengths.kept_prompts), with
    # each picture's 16 image tokens
    measured = [chat_prompts(processor, [row["prompt"]], [row["images"]])["input_ids"]
                for row in data.train]
    assert prompts == sum(ids.shape[1] for ids in measured) and \
        all((ids == processor.image_token_id).sum() == 16 for ids in measured)
    taught_by = lambda teacher: teacher_model(dataclasses.replace(job, experiment=(
        experiment.model_copy(update={"distill": experiment.distill.model_copy(
            update={"teacher": str(teacher)})}))))
    with pytest.raises(ConfigError) as caught:
        taught_by(TINY_MODEL)
    assert caught.value.problems == [
        f"distill.teacher: {TINY_MODEL} is a text model and the student a vision-language "
        "one: it would score answers about pictures it cannot see; give a vision-language "
        "teacher of the student's family (same processor)"]
    # the run just trained (its final/ and processor) teaches; one whose processor cuts
    # the pictures otherwise does not
    assert type(taught_by(tmp_path / "runs" / "vlm")).__name__ == "LlavaForConditionalGeneration"
    other = shutil.copytree(tmp_path / "teacher", tmp_path / "other")
    settings = json.loads((other / "processor_config.json").read_text())
    settings["image_processor"]["image_mean"] = [0.5, 0.5, 0.5]
    (other / "processor_config.json").write_text(json.dumps(settings))
    with pytest.raises(ConfigError) as caught:
        taught_by(other)
    assert caught.value.problems == [
        "distill.teacher: the teacher's processor differs from the student's in "
        "image_processor; the teacher sees the pictures as the student's processor prepares "
        "them"]

    from finetune.data.load import ORIGIN
    from finetune.methods.distill import _prompt_of  # a picture only the answer shows
    answered = {"messages": [{"role": "user", "content": "Draw it."}, {"role": "assistant",
                "content": [{"type": "image"}]}], "images": ["x.png"], ORIGIN: "f row 3"}
    with pytest.raises(DataError, match="^f row 3: an image part in the last assistant "
                                        "answer, which distill leaves out"):
        _prompt_of(answered, "messages")

    trainer = method_trainer(job)
    seen = []
    tower = trainer.teacher_model.model.vision_tower
    tower.register_forward_pre_hook(lambda module, args: seen.append(args[0].clone()))
    trainer.model.train()
    inputs = trainer._prepare_inputs(next(iter(trainer.get_train_dataloader())))
    with torch.no_grad():
        seeing = trainer.compute_loss(trainer.model, inputs).item()
        blank = tower.register_forward_pre_hook(lambda module, args: (torch.zeros_like(args[0]),))
        blanked = trainer.compute_loss(trainer.model, inputs).item()
        blank.remove()
    assert inputs["pixel_values"].shape == (4, 3, 32, 32)
    assert len(seen) == 2 and all(torch.equal(s, inputs["pixel_values"]) for s in seen)
    print(f"distill loss {seeing:.5f} with the teacher seeing the pictures, {blanked:.5f} "
          "with its pictures blanked")
    assert abs(seeing - blanked) > 1e-4 * abs(seeing)
