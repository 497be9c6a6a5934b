"""What preparing the data (data/prepare.py: read, validate, let the method tokenize or
check) refuses, for every method, as one DataError naming the data file and row: a chat
template that fails on a later row, pairs that all exceed max_length, grpo/ppo prompts
longer than the model's context, rows with nothing to train. Errors found while
tokenizing name the file's own row, through eval_fraction's shuffle and a directory's
files. In process (prepare() is what a run calls first), plus one CLI run."""

from __future__ import annotations

import json

import pytest

from conftest import REPO, TINY_MODEL, run_cli
from finetune.data.load import ORIGIN
from finetune.data.prepare import prepare
from finetune.methods import preparation
from finetune.model.tokenizer import load_tokenizer
from finetune.config import load_experiment
from finetune.errors import ConfigError, DataError

# Refuses conversations whose roles do not alternate user/assistant (as many hub templates).
STRICT = ("{{ bos_token }}{% for m in messages %}{% if (m['role'] == 'user') != "
          "(loop.index0 % 2 == 0) %}{{ raise_exception('roles must alternate') }}{% endif %}"
          "{{ '<|' + m['role'] + '|>' + m['content'] + eos_token }}{% endfor %}"
          "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")
USER, ANSWER = {"role": "user", "content": "sort: b a"}, {"role": "assistant", "content": "a b"}
REWARDS = f"rewards: {{functions: [{REPO}/configs/examples/rewards.py:no_repeats]}}\n"
# The completion budget of grpo and ppo: the tiny model's context is 64 positions.
BUDGET = {"grpo": "training.max_completion_length", "ppo": "ppo.max_new_tokens"}
ROWS = {  # method -> (a good row, the same row that the strict template refuses)
    "sft": ({"messages": [USER, ANSWER]}, {"messages": [USER, USER, ANSWER]}),
    "reward": ({"prompt": [USER], "chosen": [ANSWER], "rejected": [ANSWER]},
               {"prompt": [USER, USER], "chosen": [ANSWER], "rejected": [ANSWER]}),
    "dpo": ({"prompt": [USER], "chosen": [ANSWER], "rejected": [ANSWER]},
            {"prompt": [USER, USER], "chosen": [ANSWER], "rejected": [ANSWER]}),
    "grpo": ({"prompt": [USER]}, {"prompt": [USER, USER]}),
    "ppo": ({"prompt": [USER]}, {"prompt": [USER, USER]}),
}


def jsonl(path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def experiment(write, method, train, extra=""):
    return load_experiment(write("exp.yaml", (
        f"method: {method}\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
        f"data:\n  train: {train}\n{extra}{REWARDS if method in BUDGET else ''}")),
        [f"{BUDGET[method]}=8"] if method in BUDGET else [])


def prepared(exp):
    return prepare(exp, load_tokenizer(exp), preparation(exp))


def refused(exp) -> str:
    with pytest.raises(DataError) as info:
        prepared(exp)
    return str(info.value)


@pytest.mark.parametrize("method", sorted(ROWS))
def test_a_template_that_fails_on_a_later_row_names_file_and_row(write, tmp_path, method):
    good, bad = ROWS[method]
    data = jsonl(tmp_path / "d.jsonl", [good] * 3 + [bad] + [good] * 2)
    template = f"tokenizer: {{chat_template: {json.dumps(STRICT)}}}\n"
    message = refused(experiment(write, method, data, template))
    assert message.startswith(f"{data} row 4"), message
    assert "the chat template cannot render it (TemplateError: roles must alternate)" in message


def test_tokenizing_errors_name_the_files_row_through_the_split_and_a_directory(
        write, tmp_path):
    good, bad = ROWS["sft"]
    folder = tmp_path / "dir"
    jsonl(folder / "a.jsonl", [good] * 7)
    b = jsonl(folder / "b.jsonl", [good] * 9 + [bad] + [good] * 4)
    extra = f"  eval_fraction: 0.25\ntokenizer: {{chat_template: {json.dumps(STRICT)}}}\n"
    # Row 10 of b.jsonl is row 17 of the directory, and elsewhere after the shuffle.
    assert refused(experiment(write, "sft", folder, extra)).startswith(f"{b} row 10: ")


def test_the_origin_column_reaches_neither_the_trainer_nor_the_cache(write, tmp_path):
    data = jsonl(tmp_path / "g.jsonl", [{"prompt": "2+2=", "answer": "4"}] * 4)
    splits = prepared(experiment(write, "grpo", data, "  eval_fraction: 0.5\n"))
    for rows in (splits.train, splits.eval):
        assert rows.column_names == ["prompt", "answer"]  # what grpo's reward functions get
    sft = prepared(experiment(write, "sft", jsonl(tmp_path / "s.jsonl", [ROWS["sft"][0]] * 4),
                              "  eval_fraction: 0.5\n"))
    assert ORIGIN not in sft.train.column_names + sft.eval_rows.column_names
    clash = jsonl(tmp_path / "c.jsonl", [{"prompt": "2+2=", ORIGIN: "mine"}] * 2)
    with pytest.raises(DataError, match=f"{clash}: the column name {ORIGIN} is finetune's own"):
        prepared(experiment(write, "grpo", clash))


def test_reward_and_dpo_pairs_all_beyond_max_length_are_one_error(write, tmp_path):
    long = {"prompt": "p " * 200, "chosen": "a", "rejected": "b"}
    short = {"prompt": "p", "chosen": "a", "rejected": "b"}
    data = jsonl(tmp_path / "long.jsonl", [long] * 3)
    for method, trainer in (("reward", "RewardTrainer"), ("dpo", "DPOTrainer")):
        message = refused(experiment(write, method, data, "training: {max_length: 64}\n"))
        assert message.startswith("data.train: no ") and f"{data} row 1, has " in message
        assert trainer in message and "raise training.max_length" in message
    # One row that fits is enough: TRL drops the others, as it would.
    mixed = jsonl(tmp_path / "mixed.jsonl", [long, short, long])
    assert len(prepared(experiment(write, "reward", mixed, "training: {max_length: 64}\n"))
               .train) == 1
    assert len(prepared(experiment(write, "dpo", mixed, "training: {max_length: 64}\n"))
               .train) == 3


@pytest.mark.parametrize("method", sorted(BUDGET))
def test_a_prompt_beyond_the_models_context_is_refused(write, tmp_path, method):
    # 64 positions, 8 of them the completion's: a prompt may have 56 tokens.
    data = jsonl(tmp_path / "p.jsonl", [{"prompt": "a b"}] * 2 + [{"prompt": "a " * 30}])
    setting = BUDGET[method]
    assert refused(experiment(write, method, data)) == (
        f"{data} row 3: the prompt has 61 tokens; with {setting} 8 that exceeds the model's "
        f"context of 64 tokens (max_position_embeddings): shorten the prompt, or lower "
        f"{setting}")
    fits = jsonl(tmp_path / "fits.jsonl", [{"prompt": "a " * 27}] * 2)
    assert len(prepared(experiment(write, method, fits)).train) == 2
    # A budget that fills the context leaves room for no prompt: the setting is named.
    with pytest.raises(ConfigError, match=rf"{setting}: 64 leaves no room for a prompt in "
                                          r"the model's context of 64 tokens"):
        prepared(load_experiment(write("exp.yaml", (
            f"method: {method}\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {fits}\n{REWARDS}")), [f"{setting}=64"]))


def test_a_chat_completion_without_an_assistant_turn_says_so(write, tmp_path):
    row = {"prompt": [{"role": "user", "content": "p"}],
           "completion": [{"role": "user", "content": "c"}]}
    data = jsonl(tmp_path / "d.jsonl", [row] * 3)
    message = refused(experiment(write, "sft", data, "training: {assistant_only_loss: true}\n"))
    assert message == (f"{data} row 1: nothing to train: training.assistant_only_loss trains "
                       "assistant turns only, and the completion has none")


@pytest.mark.slow
def test_cli_dpo_with_a_template_failing_on_row_3_is_one_error_line(write, tmp_path):
    good, bad = ROWS["dpo"]
    data = jsonl(tmp_path / "d.jsonl", [good, good, bad, good])
    config = write("dpo.yaml", (
        f"name: d\nmethod: dpo\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
        f"data: {{train: {data}}}\ntokenizer: {{chat_template: {json.dumps(STRICT)}}}\n"
        "evaluation: {before_training: false}\ntraining: {max_steps: 1}\n"))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-2000:]
    assert f"error: {data} row 3, `prompt`: the chat template cannot render it" in result.stderr
