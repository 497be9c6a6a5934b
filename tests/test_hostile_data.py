"""Hostile and careless data files (issue 13): every one is read, or refused with one
DataError naming the file and its row or line; never another exception. The named tests
are the issue's repros; the last test fuzzes the readers with generated rows and bytes."""

from __future__ import annotations

import json
import math

import pytest

from conftest import TINY_MODEL, run_cli
from finetune.data.load import load_data
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
        "must be UTF-8: convert it (iconv -f UTF-16 -t UTF-8 IN > OUT)")
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
    # Python's json stops at its recursion limit; where a process has raised it (the suite's
    # workers run other libraries' code first), the row parses and the depth check names it
    message = refused(write, path)
    assert message == f"{path} line 2: nested too deeply to read (thousands of levels)" or \
        message.startswith(f"{path} line 2: nested more than 64 levels deep"), message
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
    infinite.write_text(json.dumps([{**CHAT, "weight": 1.0}, {**CHAT, "weight": -math.inf}]))
    assert refused(write, infinite, extra="  weight_column: weight\n") == (
        f"{infinite} row 2: `weight` is missing (null, empty or NaN)")  # datasets: null
    nested = tmp_path / "nested.json"  # inside a turn, in a JSON array
    nested.write_text(json.dumps([CHAT, bad]))
    assert refused(write, nested).startswith(f"{nested} row 2: `messages[1].weight` is NaN")
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


@pytest.mark.slow
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


def test_a_column_name_with_a_line_break_stays_in_one_error_line(write, tmp_path):
    # Found by the fuzz test below: a name from the data could start an error line.
    path = tmp_path / "c.json"
    path.write_text(json.dumps([{"\nerror: injected": "x"}]))
    message = refused(write, path, "classify", "classify: {labels: [neg, pos]}\n")
    assert message == (f"{path}: method classify needs columns text/label; found "
                       "'\\nerror: injected' (rename with data.<split>[i].columns)")


@pytest.mark.slow
def test_cli_train_on_a_non_utf8_file_is_one_error_line(write, tmp_path):
    data = tmp_path / "latin1.jsonl"
    data.write_bytes(b'{"text": "caf\xe9"}\n')
    config = write("bad.yaml", f"name: bad\nmethod: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                               f"data: {{train: {data}}}\noutput: {{dir: {tmp_path / 'run'}}}\n")
    result = run_cli("train", str(config), cwd=tmp_path, timeout=300)
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert f"error: {data} line 1: byte 0xe9 is not UTF-8" in result.stderr


def test_a_fifo_as_data_is_refused_without_blocking(write, tmp_path):
    import os
    import signal

    from finetune.errors import ConfigError
    from finetune.data.files import content_digest

    fifo = tmp_path / "pipe.jsonl"
    os.mkfifo(fifo)
    with pytest.raises(ConfigError, match="data.train\\[0\\].path: not a regular file or "
                                          "directory"):  # what `finetune validate` says
        experiment(write, "sft", fifo)
    folder = tmp_path / "dir"
    folder.mkdir()
    (folder / "a.jsonl").write_text(json.dumps(CHAT) + "\n")
    later = experiment(write, "sft", folder / "a.jsonl")
    os.mkfifo(folder / "b.jsonl")
    signal.alarm(60)  # opening a FIFO blocks until a writer comes: fail instead of hanging
    try:
        assert refused(write, folder) == \
            f"{folder / 'b.jsonl'}: a FIFO (named pipe); data paths must be regular files or " \
            "directories"
        (folder / "a.jsonl").unlink()
        os.mkfifo(folder / "a.jsonl")  # replaced after the experiment was checked
        with pytest.raises(DataError, match="a.jsonl: a FIFO"):
            load_data(later)
        assert content_digest(fifo) == "not a regular file"  # the resume fingerprint
    finally:
        signal.alarm(0)


def test_an_empty_file_and_a_lone_surrogate_are_named(write, tmp_path):
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert refused(write, empty) == f"{empty}: the file is empty"
    blank = tmp_path / "blank.jsonl"
    blank.write_text("\n\n")
    assert refused(write, blank) == f"{blank}: the file is empty (blank lines only)"
    lone = tmp_path / "surrogate.jsonl"
    lone.write_text(json.dumps(CHAT) + "\n" + json.dumps(CHAT).replace("yo", "\\ud800") + "\n")
    assert refused(write, lone) == (
        f"{lone} line 2: `messages[1].content` holds a lone surrogate escape (\\ud800-\\udfff "
        "without its pair), which is not a character")


@pytest.mark.parametrize("name, text, where, got", [
    ("numbers.jsonl", "1\n2\n", "line 1", "got int 1"),
    ("mixed.jsonl", json.dumps(CHAT) + '\n"x"\n', "line 2", "got str 'x'"),
    ("array.json", json.dumps([CHAT, 3]), "row 2", "got int 3"),
])
def test_a_row_that_is_not_an_object_is_named(write, tmp_path, name, text, where, got):
    path = tmp_path / name
    path.write_text(text)
    assert refused(write, path) == f"{path} {where}: a row must be a JSON object " \
                                   f'({{"column": value, ...}}), {got}'


# --- Fuzzing the readers: generated rows, then generated damage to their bytes ----------

from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402
import pyarrow as pa  # noqa: E402

FIELDS = ("messages", "prompt", "completion", "text", "weight", "label", "chosen", "rejected",
          "role", "content", "x")
SCALARS = (st.none() | st.booleans() | st.integers(-2**70, 2**70)
           | st.floats(allow_nan=True, allow_infinity=True)
           | st.text(max_size=20) | st.sampled_from(["user", "assistant", "robot", "neg", "pos"])
           | st.integers(1, 40_000).map(lambda n: "long " * n))  # up to 200 KB
VALUES = st.recursive(SCALARS, lambda inner: st.lists(inner, max_size=4)
                      | st.dictionaries(st.sampled_from(FIELDS), inner, max_size=4),
                      max_leaves=12)
TURN = st.fixed_dictionaries({"role": st.sampled_from(["user", "assistant", "system", "x"]),
                              "content": st.text(max_size=10) | VALUES},
                             optional={"weight": SCALARS})
VALID = st.sampled_from([CHAT, {"prompt": "2+2=", "completion": "4"}, {"text": "plain"},
                         {"prompt": "p", "chosen": "a", "rejected": "b"},
                         {"text": "good", "label": "pos"}, {"text": "bad", "label": 0},
                         {**CHAT, "weight": 0.5}, {"text": "w", "weight": 2}])
ROW = (VALID | VALID | st.dictionaries(st.sampled_from(FIELDS), VALUES, max_size=5)
       | st.fixed_dictionaries({"messages": st.lists(TURN, max_size=4)},
                               optional={"weight": SCALARS})
       | st.fixed_dictionaries({"text": SCALARS, "label": SCALARS}))
DAMAGE = st.one_of(
    st.just(("none",)), st.just(("none",)),
    st.tuples(st.just("insert"), st.integers(0, 10**6), st.binary(min_size=1, max_size=8)),
    st.tuples(st.just("truncate"), st.integers(0, 10**6)),
    st.tuples(st.just("encode"), st.sampled_from(["utf-16", "utf-16-le", "latin-1", "utf-32"])),
    st.tuples(st.just("nest"), st.integers(1, 6000)),
    st.tuples(st.just("replace"), st.binary(max_size=300)),
)
ROWS = st.lists(ROW, min_size=1, max_size=4) | st.builds(lambda row, n: [row] * n, VALID,
                                                         st.integers(1, 4))
# method -> extra YAML; sft covers messages/prompt_completion/text, dpo preference.
METHODS = {"sft": "", "dpo": "", "classify": "classify: {labels: [neg, pos]}\n",
           "sft weighted": "  weight_column: weight\n"}


def _serialized(rows: list[dict], suffix: str) -> bytes:
    if suffix == ".csv":
        import csv
        import io

        out = io.StringIO()
        columns = sorted({key for row in rows for key in row}) or ["text"]
        writer = csv.DictWriter(out, columns)
        writer.writeheader()
        for row in rows:
            writer.writerow({k: json.dumps(v) if isinstance(v, (list, dict)) else v
                             for k, v in row.items()})
        return out.getvalue().encode("utf-8", "surrogatepass")
    if suffix == ".json":
        return json.dumps(rows).encode()
    if suffix == ".parquet":
        import io

        import pyarrow as pa
        import pyarrow.parquet as pq

        out = io.BytesIO()
        pq.write_table(pa.Table.from_pylist(rows), out)  # ValueError: rows arrow cannot type
        return out.getvalue()
    return "".join(json.dumps(row) + "\n" for row in rows).encode()


def _damaged(data: bytes, damage: tuple) -> bytes:
    kind = damage[0]
    if kind == "insert":
        at = damage[1] % (len(data) + 1)
        return data[:at] + damage[2] + data[at:]
    if kind == "truncate":
        return data[:damage[1] % (len(data) + 1)]
    if kind == "encode":
        if data.startswith(b"PAR1"):
            return data[::-1]
        return data.decode("utf-8", "surrogatepass").encode(damage[1], "surrogatepass")
    if kind == "replace":
        return damage[1]
    if kind == "nest":
        return data + b'{"text": ' + b"[" * damage[1] + b"]" * damage[1] + b"}\n"
    return data


@pytest.mark.slow
def test_fuzz_the_data_readers_give_rows_or_one_data_error(write, tmp_path):
    """Generated rows (wrong types, missing fields, NaN/inf weights, long strings) written
    as JSON Lines, a JSON array or CSV, then damaged (bytes inserted, cut short, another
    encoding, nested thousands deep): load_data returns rows or raises one DataError that
    names the file; nothing else escapes."""
    experiments = {}
    for name, extra in METHODS.items():
        method = name.split()[0]
        for suffix in (".jsonl", ".json", ".csv", ".parquet"):
            path = tmp_path / f"{name.replace(' ', '_')}{suffix}"
            path.write_text('{"text": "x"}\n')
            extra_data = extra if extra.startswith("  ") else ""
            experiments[name, suffix] = (path, load_experiment(write(
                f"{name.replace(' ', '_')}{suffix}.yaml",
                f"method: {method}\nmodel: {{name_or_path: {TINY_MODEL}}}\ndata:\n"
                f"  train: {path}\n{extra_data}{'' if extra_data else extra}")))
    counts = {"tried": 0, "rows": 0, "data errors": 0}

    @settings(max_examples=600, deadline=None, derandomize=True, database=None,
              suppress_health_check=list(HealthCheck))
    @given(st.sampled_from(sorted(experiments)), ROWS, DAMAGE)
    def one(key, rows, damage):
        path, exp = experiments[key]
        try:
            data = _damaged(_serialized(rows, path.suffix), damage)
        except (UnicodeEncodeError, ValueError, OverflowError, TypeError, pa.ArrowException):
            return  # a lone surrogate has no encoding there, arrow no type: no file
        path.write_bytes(data)
        counts["tried"] += 1
        try:
            load_data(exp)
            counts["rows"] += 1
        except DataError as exc:
            counts["data errors"] += 1
            assert str(path) in str(exc), str(exc)
            assert str(exc).isprintable(), str(exc)  # one line, nothing injected

    one()
    print(f"fuzzed the data readers: {counts}")
    assert counts["tried"] >= 500 and counts["rows"] >= 20 and counts["data errors"] >= 300
