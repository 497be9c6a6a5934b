"""Hostile and careless data files (issue 13): every one is read, or refused with one
DataError naming the file and its row or line; never another exception. The named tests
are the issue's repros; the last test fuzzes the readers with generated rows and bytes."""

from __future__ import annotations

import json
import math

import pytest

from conftest import TINY_MODEL, run_cli
from finetune.build.data import load_data
from finetune.config import load_experiment
from finetune.errors import DataError

CHAT = {"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "yo"}]}


def experiment(write, method, train, extra=""):
    return load_experiment(write("exp.yaml", f"method: {method}\nmodel:\n  name_or_path: "
                                             f"{TINY_MODEL}\ndata:\n  train: {train}\n{extra}"))


def refused(write, path, method="sft", extra="") -> str:
    with pytest.raises(DataError) as info:
        load_data(experiment(write, method, path, extra))
    return str(info.value)


def test_non_utf8_bytes_name_the_line_and_the_byte(write, tmp_path):
    path = tmp_path / "latin1.jsonl"
    path.write_bytes(b'{"text": "a"}\n{"text": "caf\xe9 \xff"}\n')
    assert refused(write, path).startswith(
        f"{path} line 2: byte 0xe9 is not UTF-8 (invalid continuation byte); data files must "
        "be UTF-8")
    csv = tmp_path / "latin1.csv"
    csv.write_bytes(b"prompt,completion\np,c\ncaf\xe9,x\n")
    assert refused(write, csv).startswith(f"{csv} line 3: byte 0xe9 is not UTF-8")


def test_a_utf16_file_is_named_as_such(write, tmp_path):
    path = tmp_path / "utf16.jsonl"
    path.write_text('{"text": "hello"}\n' * 3, encoding="utf-16")
    assert refused(write, path) == (
        f"{path}: the file is UTF-16 (it starts with a UTF-16 byte-order mark); data files "
        "must be UTF-8: convert it (e.g. iconv -f UTF-16 -t UTF-8 IN > OUT)")
    bare = tmp_path / "utf16le.jsonl"  # no byte-order mark: NUL bytes between the letters
    bare.write_bytes('{"text": "hello"}\n'.encode("utf-16-le"))
    assert refused(write, bare).startswith(f"{bare} line 1: a NUL byte")


def test_a_utf8_byte_order_mark_is_accepted(write, tmp_path):
    path = tmp_path / "bom.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + b'{"text": "hello"}\n' * 2)
    assert len(load_data(experiment(write, "sft", path)).train) == 2


def test_a_5000_deep_json_row_is_one_error(write, tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "ok"}\n{"text": ' + "[" * 5000 + "]" * 5000 + "}\n")
    assert refused(write, path) == f"{path} line 2: nested too deeply to read (thousands of levels)"
    moderate = tmp_path / "moderate.jsonl"  # within Python's reach, beyond datasets'
    moderate.write_text('{"text": "ok"}\n{"text": ' + "[" * 400 + "]" * 400 + "}\n")
    message = refused(write, moderate)
    assert message.startswith(f"{moderate} line 2: nested more than 64 levels deep") or \
        message.startswith(f"{moderate} row 2: `text` must be a string"), message


def test_a_nan_turn_weight_is_an_error_naming_file_line_and_turn(write, tmp_path):
    path = tmp_path / "weights.jsonl"
    good = {"messages": [{"role": "user", "content": "hi"},
                         {"role": "assistant", "content": "yo", "weight": 2.0}]}
    bad = {"messages": [{"role": "user", "content": "hi"},
                        {"role": "assistant", "content": "yo", "weight": math.nan}]}
    path.write_text(json.dumps(good) + "\n" + json.dumps(bad) + "\n")  # writes NaN
    assert refused(write, path) == (
        f"{path} line 2: `messages[1].weight` is NaN: JSON has no NaN or Infinity (a NaN "
        "weight is an error, and datasets would read it as null)")
    infinite = tmp_path / "inf.json"  # a JSON array document, and a row weight
    infinite.write_text(json.dumps([CHAT, {**CHAT, "weight": -math.inf}], indent=1))
    assert refused(write, infinite, extra="  weight_column: weight\n").startswith(
        f"{infinite} row 2: `weight` is -Infinity")
    # "NaN" and "Infinity" in text are text.
    words = tmp_path / "words.jsonl"
    words.write_text(json.dumps({"text": "NaN and Infinity are words; Info too"}) + "\n")
    assert len(load_data(experiment(write, "sft", words)).train) == 1


@pytest.mark.parametrize("content,cause", [
    ("prompt,completion\np,c\np,c,d,e\n", "Expected 2 fields in line 3, saw 4"),
    ('prompt,completion\np,c\n"p,c\np,c\n', "EOF inside string starting at line 3"),
])
def test_csv_read_errors_name_line_and_cause(write, tmp_path, content, cause):
    path = tmp_path / "d.csv"
    path.write_text(content)
    assert refused(write, path) == f"{path}: cannot read as csv: {cause}"


def test_classify_csv_label_names_become_the_ids_of_classify_labels(write, tmp_path):
    path = tmp_path / "c.csv"
    path.write_text("text,label\nhello there,pos\nawful,neg\nfine,pos\nmeh,neutral\n")
    exp = experiment(write, "classify", path, "classify: {labels: [neg, neutral, pos]}\n")
    splits = load_data(exp)
    assert splits.train["label"] == [2, 0, 2, 1]
    assert splits.train.features["label"].dtype == "int64"  # was text: died in the collator
    unknown = tmp_path / "u.csv"
    unknown.write_text("text,label\nhello,pos\nbad,negative\n")
    assert refused(write, unknown, "classify", "classify: {labels: [neg, pos]}\n") == (
        f"{unknown} row 2: `label` 'negative' is not one of classify.labels (neg, pos)")


def test_cli_classify_csv_with_label_names_trains_and_says_the_mapping(write, tmp_path):
    data = tmp_path / "c.csv"
    data.write_text("text,label\nhello there,pos\nawful,neg\nfine,pos\nmeh,neutral\n")
    config = write("cl.yaml", (
        f"name: cl\nmethod: classify\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
        f"data: {{train: {data}}}\nclassify: {{labels: [neg, neutral, pos]}}\n"
        "evaluation: {before_training: false}\noutput: {plot: false, save_final: false}\n"
        "training: {max_steps: 1, per_device_train_batch_size: 4}\n"))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "  labels     0 neg, 1 neutral, 2 pos (classify.labels)" in result.stdout


def test_cli_train_on_a_non_utf8_file_is_one_error_line(write, tmp_path):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"text": "caf\xe9"}\n')
    config = write("bad.yaml", f"name: bad\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                               f"data: {{train: {data}}}\noutput: {{dir: {tmp_path / 'run'}}}\n")
    result = run_cli("train", str(config), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert f"error: {data} line 1: byte 0xe9 is not UTF-8" in result.stderr
