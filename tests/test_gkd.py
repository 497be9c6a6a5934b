"""method gkd (TRL's experimental GKDTrainer): validation naming the YAML paths, the rows it
reads (conversations; prompt/completion message lists converted; text rows refused by
row), end-to-end runs with full fine-tuning, LoRA and QLoRA, on the data's completions,
the student's samples (lmbda) and the teacher's (seq_kd), and a learning test: the
student's held-out KL toward the teacher falls. Exact resume and data parallelism are in
test_resume.py and test_data_parallel.py."""

from __future__ import annotations

import json

import pytest
import yaml

from conftest import DATA, QUICKSTART, REPO, TINY_MODEL, run_cli
from finetune.config.load import load_experiment
from finetune.errors import ConfigError, DataError
from teachers import held_out_kl, tiny_teacher

# One worker runs this module: its module fixture (teacher) trains once, not once per worker.
pytestmark = pytest.mark.xdist_group("gkd")


def experiment(teacher, peft: str = "none", extra: str = "", steps: int = 3,
               train: str = "sft_train.jsonl", lmbda: float = 0.0) -> str:
    peft_block = f"peft:\n  type: {peft}\n  r: 4\n" if peft != "none" else ""
    return (f"method: gkd\nmodel:\n  name_or_path: {TINY_MODEL}\n  init: random\n"
            f"{peft_block}distill: {{teacher: {teacher}}}\n"
            f"data:\n  train: {{path: {DATA}/{train}, max_samples: 32}}\n"
            f"  eval: {{path: {DATA}/sft_eval.jsonl, max_samples: 8}}\n"
            f"output: {{plot: false}}\n"
            f"training:\n  max_steps: {steps}\n  per_device_train_batch_size: 8\n"
            "  logging_steps: 1\n  learning_rate: 1e-3\n  max_length: 64\n"
            f"  max_new_tokens: 8\n  lmbda: {lmbda}\n  activation_checkpointing: false\n" + extra)


def _problems(write, text: str, *overrides: str) -> str:
    try:
        load_experiment(write("g.yaml", text), list(overrides))
    except ConfigError as exc:
        return str(exc)
    return ""


def test_settings_are_validated_with_their_paths(write):
    without = experiment("x").replace("distill: {teacher: x}\n", "")
    assert "distill: method gkd needs distill.teacher" in _problems(write, without)
    text = experiment(TINY_MODEL)
    assert _problems(write, text) == ""
    assert "data.weight_column: not used by method gkd: its trainer has no per-sample loss " \
           "weights" in _problems(write, text, "data.weight_column=w")
    assert "data.format: method gkd takes auto, messages, prompt_completion, alpaca, " \
           "sharegpt" in _problems(write, text, "data.format=text")
    assert "training.teacher_model_name_or_path: not set here: finetune sets it from " \
           "`distill.teacher`" in _problems(write, text, "training.teacher_model_name_or_path=x")
    assert "training.lmbd: unknown" in _problems(write, text, "training.lmbd=0.5")


def test_preference_data_is_refused_naming_the_file(write, tmp_path):
    config = write("p.yaml", experiment(TINY_MODEL, train="pref_train.jsonl"))
    result = run_cli("validate", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"{DATA}/pref_train.jsonl: method gkd needs columns messages or prompt/completion" \
        in result.stderr


def _prepared(write, rows: list[dict]):
    """The rows of a file through data/prepare.py with gkd's preparation."""
    from finetune.data.prepare import prepare
    from finetune.methods.gkd import prepare as gkd_prepare
    from finetune.model.tokenizer import load_tokenizer

    data = write("rows.jsonl", "".join(json.dumps(r) + "\n" for r in rows))
    text = experiment(TINY_MODEL).replace(f"{DATA}/sft_train.jsonl", str(data)) \
        .replace(f"  eval: {{path: {DATA}/sft_eval.jsonl, max_samples: 8}}\n", "")
    spec = load_experiment(write("rows.yaml", text))
    return prepare(spec, load_tokenizer(spec), gkd_prepare)


USER, ANSWER = {"role": "user", "content": "sort: b a"}, {"role": "assistant", "content": "a b"}


@pytest.mark.slow  # imports trl and reads five files through datasets
def test_rows_become_conversations_or_are_refused_by_row(write):
    converted = _prepared(write, [{"prompt": [USER], "completion": [ANSWER]}] * 2)
    assert converted.format == "messages" and converted.train.column_names == ["messages"]
    assert [m["content"] for m in converted.train[0]["messages"]] == ["sort: b a", "a b"]
    refusals = {
        "a text prompt/completion row: gkd reads conversations":
            {"prompt": "sort: b a", "completion": " a b"},
        "`messages`: gkd trains the last turn, which must be an assistant answer":
            {"messages": [ANSWER, USER]},
        "`completion`: gkd trains one assistant turn; this has ['assistant', 'user']":
            {"prompt": [USER], "completion": [ANSWER, USER]},
        "the completion has 140 tokens, filling training.max_length 64":
            {"messages": [USER, {"role": "assistant", "content": "a " * 69}]},
    }
    for message, row in refusals.items():
        with pytest.raises(DataError) as caught:
            _prepared(write, [row, row])
        assert "rows.jsonl row 1: " in str(caught.value) and message in str(caught.value), \
            str(caught.value)


def test_example_config_validates(online):
    exp = load_experiment(REPO / "configs" / "examples" / "qwen2.5-0.5b-gkd-lora.yaml")
    assert (exp.method, exp.distill.teacher, exp.peft.type) == (
        "gkd", "Qwen/Qwen2.5-1.5B-Instruct", "lora")
    assert exp.training["lmbda"] == 0.0


@pytest.fixture(scope="module")
def teacher(tmp_path_factory):
    """A finetune sft run of the quickstart (a few seconds): the teacher's final/."""
    root = tmp_path_factory.mktemp("teacher")
    result = run_cli("train", str(QUICKSTART / "sft.yaml"), "name=teacher",
                     "training.max_steps=40", "training.learning_rate=3e-3",
                     "evaluation.exact_match=false", "evaluation.before_training=false",
                     "output.plot=false", cwd=root)
    assert result.returncode == 0, result.stderr[-3000:]
    return root / "runs" / "teacher"


@pytest.mark.slow
@pytest.mark.parametrize("peft,mode", [("none", "data"), ("lora", "on-policy"),
                                       ("qlora", "seq_kd")])
def test_train_writes_a_complete_run_directory(peft, mode, teacher, write, tmp_path):
    source = teacher if peft == "lora" else tiny_teacher(tmp_path / "teacher")
    text = experiment(source, peft, "  seq_kd: true\n" if mode == "seq_kd" else "",
                      lmbda=1.0 if mode == "on-policy" else 0.0)
    result = run_cli("train", str(write(f"g-{peft}.yaml", text)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    run = tmp_path / "runs" / f"g-{peft}"
    assert yaml.safe_load((run / "experiment.yaml").read_text())["distill"]["teacher"] == \
        str(source)
    args = json.loads((run / "training_args.json").read_text())
    assert (args["lmbda"], args["seq_kd"], args["max_new_tokens"], args["beta"]) == (
        1.0 if mode == "on-policy" else 0.0, mode == "seq_kd", 8, 0.5)
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    losses = [r["loss"] for r in records if "loss" in r]
    assert len(losses) == 3 and all(isinstance(x, float) and x == x and x >= 0 for x in losses)
    summary = json.loads((run / "summary.json").read_text())
    assert summary["global_step"] == 3 and "eval_loss" in summary["after"]
    final = run / "final"
    assert (final / "tokenizer.json").exists()
    assert (final / ("model.safetensors" if peft == "none" else
                     "adapter_model.safetensors")).exists()
    assert f"peft {peft}" in result.stdout and "method     gkd" in result.stdout
    assert "finetune: done in" in result.stdout


@pytest.mark.slow
def test_the_student_learns_the_teacher(teacher, write, tmp_path):
    """Forward KL (beta 0) on the data's completions (lmbda 0), 60 steps from random
    weights: the held-out KL toward the teacher (on the teacher's own answers) and the
    eval loss (the same divergence on the held-out data) both fall."""
    config = write("learn.yaml", experiment(teacher, steps=60).replace(
        "max_samples: 32}", "max_samples: 2000}").replace("max_samples: 8}", "max_samples: 32}"))
    result = run_cli("train", str(config), "training.beta=0.0", "training.learning_rate=3e-3",
                     "training.per_device_train_batch_size=16", "training.save_strategy='no'",
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
