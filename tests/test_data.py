"""Data loading: formats, file types, column renames, splits, and bad rows reported with
their file and row number."""

from __future__ import annotations

import json

import pandas as pd
import pytest

from conftest import TINY_MODEL, jsonl
from finetune.data.load import ORIGIN, load_data
from finetune.config import load_experiment
from finetune.errors import ConfigError, DataError


def experiment(write, method, train, extra=""):
    return load_experiment(write("exp.yaml", f"method: {method}\nmodel:\n  name_or_path: "
                                             f"{TINY_MODEL}\ndata:\n  train: {train}\n{extra}"))


CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


@pytest.mark.parametrize("rows,fmt", [
    ([CHAT], "messages"),
    ([{"prompt": "2+2=", "completion": "4"}], "prompt_completion"),
    ([{"text": "plain text"}], "text"),
])
def test_sft_formats_detected(write, tmp_path, rows, fmt):
    path = jsonl(tmp_path, "d.jsonl", rows * 5)
    splits = load_data(experiment(write, "sft", path))
    assert splits.format == fmt and len(splits.train) == 5 and splits.eval is None


@pytest.mark.parametrize("row,message", [
    ({"messages": []}, "row 3: `messages` is an empty conversation"),
    ({"messages": [{"role": "user", "content": "x"}]}, "row 3: no assistant message to learn from"),
    ({"messages": [{"role": "robot", "content": "x"}]}, "row 3: `messages[0].role` is 'robot'"),
    ({"messages": [{"role": "user"}]}, "row 3: `messages[0]` must have `role` and `content`"),
    ({"messages": None}, "row 3: missing `messages`"),
])
def test_bad_conversation_rows_name_file_and_row(write, tmp_path, row, message):
    path = jsonl(tmp_path, "chat.jsonl", [CHAT, CHAT, row, CHAT])
    with pytest.raises(DataError) as info:
        load_data(experiment(write, "sft", path))
    assert str(info.value).startswith(f"{path} {message}"), str(info.value)


def test_invalid_json_line_is_located(write, tmp_path):
    path = tmp_path / "broken.jsonl"
    path.write_text(json.dumps(CHAT) + "\n" + json.dumps(CHAT) + "\n{not json\n")
    with pytest.raises(DataError, match=rf"{path} line 3: invalid JSON"):
        load_data(experiment(write, "sft", path))


def test_missing_columns_are_named(write, tmp_path):
    path = jsonl(tmp_path, "d.jsonl", [{"question": "q", "answer": "a"}])
    with pytest.raises(DataError, match="needs columns messages or prompt/completion or text "
                                        r"or instruction/output \(alpaca\) or conversations "
                                        r"\(sharegpt\); found answer, question"):
        load_data(experiment(write, "sft", path))
    exp = experiment(write, "sft", f"{{path: {path}, columns: {{prompt: question, "
                                   "completion: answer}}")
    assert load_data(exp).train[0] == {"prompt": "q", "completion": "a",
                                       ORIGIN: f"{path} row 1"}


def test_csv_and_parquet_rows(write, tmp_path):
    rows = [{"prompt": "p", "completion": "c"}] * 3 + [{"prompt": "p", "completion": "  "}]
    csv_path = tmp_path / "d.csv"
    pd.DataFrame(rows).to_csv(csv_path, index=False)
    with pytest.raises(DataError, match=rf"{csv_path} row 4: `completion` is empty"):
        load_data(experiment(write, "sft", csv_path))
    parquet = tmp_path / "d.parquet"
    pd.DataFrame(rows[:3]).to_parquet(parquet)
    assert len(load_data(experiment(write, "sft", parquet)).train) == 3


def test_directory_of_files_and_eval_fraction(write, tmp_path):
    (tmp_path / "dir").mkdir()
    for i in range(2):
        jsonl(tmp_path / "dir", f"part{i}.jsonl", [{"text": f"row {i} {j}"} for j in range(50)])
    splits = load_data(experiment(write, "sft", tmp_path / "dir", "  eval_fraction: 0.1\n"))
    assert len(splits.train) == 90 and len(splits.eval) == 10
    texts = set(splits.train["text"]) | set(splits.eval["text"])
    assert len(texts) == 100


def test_preference_rows(write, tmp_path):
    good = {"prompt": "p", "chosen": "a", "rejected": "b"}
    path = jsonl(tmp_path, "p.jsonl", [{"chosen": "p a", "rejected": "p b"}] * 2)
    # prompt is optional: TRL takes the common prefix of chosen and rejected as the prompt
    assert len(load_data(experiment(write, "reward", path)).train) == 2
    assert len(load_data(experiment(write, "dpo", path)).train) == 2
    bad = jsonl(tmp_path, "b.jsonl", [good, {"prompt": "p", "chosen": "a", "rejected": 3}])
    with pytest.raises(DataError, match=r"b.jsonl row 2: `rejected` must be text or a list of messages, got int"):
        load_data(experiment(write, "dpo", bad))
    # (a text prompt before message lists is read as the user turn: tests/test_formats.py)
    mixed = jsonl(tmp_path, "m.jsonl", [{"prompt": [{"role": "user", "content": "p"}],
                                         "chosen": "a", "rejected": "b"}])
    with pytest.raises(DataError, match="row 1: mixes plain text and message lists"):
        load_data(experiment(write, "dpo", mixed))


def test_unreachable_hub_dataset_is_a_clear_error(write, monkeypatch):
    # The suite runs offline: validate refuses a hub dataset that is not cached...
    with pytest.raises(ConfigError, match=r"data.train\[0\].path: 'trl-lib/Capybara' is not "
                                          r"a local path, and cannot be fetched"):
        experiment(write, "sft", "trl-lib/Capybara")
    # ...and where it cannot load anyway (datasets read its offline flag at import), the
    # reader says so with the YAML path.
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.delenv("HF_DATASETS_OFFLINE")
    exp = experiment(write, "sft", "trl-lib/Capybara")
    with pytest.raises(DataError, match=r"data.train\[0\]: cannot load hub dataset "
                                        r"'trl-lib/Capybara'"):
        load_data(exp)


@pytest.mark.parametrize("rows,fraction,left", [(1, 0.05, 0), (3, 0.99, 0)])
def test_an_eval_fraction_leaving_no_training_row_is_refused(write, tmp_path, rows, fraction,
                                                             left):
    path = jsonl(tmp_path, "d.jsonl", [{"text": f"row {i}"} for i in range(rows)])
    with pytest.raises(DataError) as info:
        load_data(experiment(write, "sft", path, f"  eval_fraction: {fraction}\n"))
    assert str(info.value) == (
        f"data.eval_fraction: {fraction} of the {rows} training row(s) holds out {rows - left} "
        f"for eval and leaves {left} to train on; both need at least 1 (more rows, another "
        "fraction, or data.eval)")


@pytest.mark.parametrize("method", ["reward", "dpo"])
def test_preference_prompts_on_every_row_or_none(write, tmp_path, method):
    with_prompt = {"prompt": "p", "chosen": "a", "rejected": "b"}
    path = jsonl(tmp_path, "p.jsonl", [with_prompt, {**with_prompt, "prompt": None},
                                       with_prompt])
    with pytest.raises(DataError) as info:
        load_data(experiment(write, method, path))
    assert str(info.value) == (f"{path} row 2: `prompt` is missing (null) while other rows of "
                               "this file have one: give every row a prompt, or none")
    # null on every row is no prompt at all (dpo then takes what chosen and rejected share)
    none = jsonl(tmp_path, "n.jsonl", [{**with_prompt, "prompt": None}] * 2)
    assert "prompt" not in load_data(experiment(write, method, none)).train.column_names


def test_dpo_chat_rows_without_prompt_must_share_their_leading_turns(write, tmp_path):
    def pair(first, second):
        return {"chosen": [{"role": "user", "content": first},
                           {"role": "assistant", "content": "a"}],
                "rejected": [{"role": "user", "content": second},
                             {"role": "assistant", "content": "b"}]}

    path = jsonl(tmp_path, "d.jsonl", [pair("p", "p"), pair("p", "q")])
    with pytest.raises(DataError) as info:
        load_data(experiment(write, "dpo", path))
    assert str(info.value).startswith(
        f"{path} row 2: `chosen` and `rejected` share no leading turn: without `prompt`, both "
        "must start with the same prompt turns")
    assert len(load_data(experiment(write, "reward", path)).train) == 2  # reward has no need


def test_a_directory_of_int_and_float_weights_concatenates(write, tmp_path):
    folder = tmp_path / "dir"
    folder.mkdir()
    jsonl(folder, "a.jsonl", [{**CHAT, "w": 1}] * 2)
    jsonl(folder, "b.jsonl", [{**CHAT, "w": 2.5}] * 2)
    splits = load_data(experiment(write, "sft", folder, "  weight_column: w\n"))
    assert splits.train["weight"] == [1.0, 1.0, 2.5, 2.5]
    # Schemas that still differ name the two files.
    jsonl(folder, "c.jsonl", [{**CHAT, "w": 1, "messages": [
        {**m, "name": "x"} for m in CHAT["messages"]]}])
    with pytest.raises(DataError) as info:
        load_data(experiment(write, "sft", folder, "  weight_column: w\n"))
    assert str(info.value).startswith(f"data.train[0]: {folder / 'a.jsonl'} and "
                                      f"{folder / 'c.jsonl'} do not share one schema")
