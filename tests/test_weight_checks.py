"""Bad weights and labels are clear errors that name the file and row, never a silent NaN
loss. (The config rules of weights, labels and reward settings: tests/config/test_rules.py.)"""

from __future__ import annotations

import json

import pytest

from conftest import TINY_MODEL, run_cli
from finetune.data.load import load_data
from finetune.config import load_experiment
from finetune.errors import DataError
from finetune.trainers.classify import balanced_weights

CHAT = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]
CLASSIFY = "classify: {labels: [neg, pos]}\n"


def jsonl(tmp_path, rows, name="d.jsonl"):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def load(write, method, train, extra=""):
    return load_data(load_experiment(write("exp.yaml", f"method: {method}\nmodel:\n  "
                                                       f"name_or_path: {TINY_MODEL}\ndata:\n"
                                                       f"  train: {train}\n{extra}")))


@pytest.mark.parametrize("weight,message", [
    (-1.0, "row 2: `weight` is -1.0; weights must be finite and >= 0"),
    (float("inf"), "row 2: `weight` is inf; weights must be finite"),
    ("2", "row 1: `weight` must be a number, got str '1'"),  # a column of strings
    (None, "row 2: `weight` is missing \\(null, empty or NaN\\)"),
    (float("nan"), "row 2: `weight` is"),
])
def test_bad_sample_weights_name_the_row(write, tmp_path, weight, message):
    rows = [{"messages": CHAT, "w": 1.0}, {"messages": CHAT, "w": weight}]
    if isinstance(weight, str):
        rows[0]["w"] = "1"
    with pytest.raises(DataError, match=message):
        load(write, "sft", jsonl(tmp_path, rows), "  weight_column: w\n")


def test_nan_weight_in_csv_is_refused(write, tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("text,label,w\ngood one,pos,1\nbad one,neg,nan\n")
    with pytest.raises(DataError, match="d.csv row 2: `weight` is missing"):
        load(write, "classify", path, "  weight_column: w\n" + CLASSIFY)


def test_missing_weight_column_is_named(write, tmp_path):
    with pytest.raises(DataError, match="no weight column 'w' \\(data.weight_column\\); "
                                        "columns: messages"):
        load(write, "sft", jsonl(tmp_path, [{"messages": CHAT}]), "  weight_column: w\n")


def test_turn_weights_only_on_assistant_messages(write, tmp_path):
    bad = [{"role": "user", "content": "hi", "weight": 2.0}, CHAT[1]]
    with pytest.raises(DataError, match="row 1: `messages\\[0\\].weight` is on a user message"):
        load(write, "sft", jsonl(tmp_path, [{"messages": bad}]))
    good = [CHAT[0], {**CHAT[1], "weight": 0.5}]
    splits = load(write, "sft", jsonl(tmp_path, [{"messages": good}, {"messages": CHAT}]))
    assert [m.get("weight") for m in splits.train[0]["messages"]] == [None, 0.5]


def test_classification_labels_by_name_or_index(write, tmp_path):
    splits = load(write, "classify", jsonl(tmp_path, [{"text": "a", "label": "pos"},
                                                      {"text": "b", "label": "neg"}]), CLASSIFY)
    assert splits.format == "classification" and splits.train["label"] == [1, 0]
    with pytest.raises(DataError, match="row 2: `label` 'maybe' is not one of classify.labels"):
        load(write, "classify", jsonl(tmp_path, [{"text": "a", "label": "pos"},
                                                 {"text": "b", "label": "maybe"}]), CLASSIFY)
    with pytest.raises(DataError, match="row 1: `label` 2 is out of range for 2 classes"):
        load(write, "classify", jsonl(tmp_path, [{"text": "a", "label": 2}]), CLASSIFY)


def test_balanced_class_weights():
    assert balanced_weights([0, 0, 0, 1], ["a", "b"]) == [4 / 6, 4 / 2]
    with pytest.raises(DataError, match="none of c"):
        balanced_weights([0, 1], ["a", "b", "c"])


@pytest.mark.slow
def test_all_zero_weights_stop_with_a_clear_error(write, tmp_path):
    rows = [{"messages": CHAT, "w": 0.0}] * 4
    config = write("zero.yaml", f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
                                f"data: {{train: {jsonl(tmp_path, rows)}, weight_column: w}}\n"
                                "evaluation: {before_training: false}\n"
                                "training: {max_steps: 2, per_device_train_batch_size: 4}\n")
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "error: every loss weight in the global batch of step 1 is 0" in result.stderr
    assert "nan" not in result.stdout.lower()


def test_weights_above_1e6_are_refused(write, tmp_path):
    """1e38 is finite, but sum(w x loss) overflows float32: the model trained to NaN."""
    rows = [{"messages": CHAT, "w": 1e6}, {"messages": CHAT, "w": 1e38}]
    with pytest.raises(DataError) as info:
        load(write, "sft", jsonl(tmp_path, rows), "  weight_column: w\n")
    assert str(info.value) == (
        f"{tmp_path / 'd.jsonl'} row 2: `weight` is 1e+38; weights are relative (the loss is "
        "sum(w x loss) / sum(w)) and at most 1,000,000: scale them down")
    turn = [CHAT[0], {**CHAT[1], "weight": 1e7}]
    with pytest.raises(DataError, match=r"row 1: `messages\[1\].weight` is 1e\+07; weights are "
                                        "relative"):
        load(write, "sft", jsonl(tmp_path, [{"messages": turn}]))
