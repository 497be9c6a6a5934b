"""`finetune validate` reads the data (data/scan.py): every row of every local source,
checked as training checks it, so a bad row is an error naming file, line and field before
any model loads; `--no-data` skips the pass. The equivalence test holds validate's error to
training's (data/load.py) on the same bad files: one set of checks, two readers."""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from conftest import DATA, TINY_MODEL, run_cli, jsonl
from finetune.config import load_experiment
from finetune.data.scan import check_data
from finetune.errors import DataError

USER = {"role": "user", "content": "hi"}
ASSISTANT = {"role": "assistant", "content": "yo"}
CHAT = {"messages": [USER, ASSISTANT]}


def config(write, method, train, extra=""):
    return write("exp.yaml", f"method: {method}\nmodel:\n  name_or_path: {TINY_MODEL}\n"
                             f"data:\n  train: {train}\n{extra}")


def test_a_bad_row_deep_in_a_big_file_is_named_by_validate_and_skipped_with_no_data(
        write, tmp_path):
    rows = [CHAT] * 40_000
    rows[34_566] = {"messages": [USER, {"role": "assistant", "content": "x", "weight": -1}]}
    path = jsonl(tmp_path, "big.jsonl", rows)
    exp = config(write, "sft", path)
    result = run_cli("validate", str(exp), cwd=tmp_path)
    assert result.returncode == 2, result.stderr
    assert f"{path} line 34567: `messages[1].weight` is -1; weights must be finite and >= 0" \
        in result.stderr
    assert "Traceback" not in result.stderr and "ok (" not in result.stdout
    skipped = run_cli("validate", str(exp), "--no-data", cwd=tmp_path)
    assert skipped.returncode == 0 and ": ok (sft" in skipped.stdout, skipped.stderr
    assert "rows" not in skipped.stdout  # the data was not read


def test_validate_says_what_it_read_per_source(write, tmp_path):
    result = run_cli("validate", str(config(write, "sft", f"{DATA}/sft_train.jsonl",
                                            f"  eval: {DATA}/sft_eval.jsonl")), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == [
        f"data.train[0]: {DATA}/sft_train.jsonl: 4000 rows, format messages",
        f"data.eval[0]: {DATA}/sft_eval.jsonl: 200 rows, format messages"]
    assert result.stderr == ""  # under a second: no progress bar


def test_a_weighted_mixture_is_read_source_by_source(write, tmp_path):
    good = jsonl(tmp_path, "good.jsonl", [CHAT] * 30)
    folder = tmp_path / "parts"
    folder.mkdir()
    jsonl(folder, "a.jsonl", [CHAT] * 5)
    bad = jsonl(folder, "b.jsonl", [CHAT, {"messages": [USER]}])
    mix = f"\n    - path: {good}\n      weight: 3\n    - path: {folder}\n      weight: 1"
    result = run_cli("validate", str(config(write, "sft", mix)), cwd=tmp_path)
    assert result.returncode == 2
    assert f"error: {bad} line 2: no assistant message to learn from" in result.stderr
    bad.write_text(json.dumps(CHAT) + "\n")
    result = run_cli("validate", str(config(write, "sft", mix)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines()[:2] == [f"data.train[0]: {good}: 30 rows, format messages",
                                              f"data.train[1]: {folder}: 6 rows, format messages"]


def test_csv_and_parquet_rows_are_checked(write, tmp_path):
    csv = tmp_path / "labels.csv"
    csv.write_text("text,label\n" + "good film,pos\n" * 40 + "bad film,meh\n")
    extra = "classify:\n  labels: [neg, pos]"
    result = run_cli("validate", str(config(write, "classify", csv, extra)), cwd=tmp_path)
    assert result.returncode == 2
    assert f"{csv} row 41: `label` 'meh' is not one of classify.labels (neg, pos)" \
        in result.stderr
    table = pa.Table.from_pylist([CHAT] * 9 + [{"messages": [USER, {"role": "robot",
                                                                     "content": "x"}]}])
    parquet = tmp_path / "chat.parquet"
    pq.write_table(table, parquet)
    result = run_cli("validate", str(config(write, "sft", parquet)), cwd=tmp_path)
    assert result.returncode == 2
    assert f"{parquet} row 10: `messages[1].role` is 'robot'" in result.stderr


def test_a_hub_source_is_named_as_not_read(write, tmp_path, online):
    exp = load_experiment(config(write, "sft", f"{DATA}/sft_eval.jsonl",
                                 "  eval: some-org/some-dataset"))
    assert check_data(exp)[1] == ("data.eval[0]: hub dataset some-org/some-dataset: rows not "
                                  "read (validate reads local files; training checks these rows)")


SHAREGPT = {"conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"}]}
PAIR = {"prompt": [USER], "chosen": [ASSISTANT], "rejected": [ASSISTANT]}
# (method, rows of the file, extra YAML): each one bad; training and validate must agree.
BAD = {
    "role": ("sft", [CHAT, {"messages": [USER, {"role": "bot", "content": "x"}]}], ""),
    "no assistant": ("sft", [CHAT, CHAT, {"messages": [USER]}], ""),
    "turn weight": ("sft", [CHAT, {"messages": [USER, {**ASSISTANT, "weight": "x"}]}], ""),
    "column weight": ("sft", [{**CHAT, "w": 1}, {**CHAT, "w": -2}],
                      "  weight_column: w"),
    "no weight column": ("sft", [CHAT], "  weight_column: w"),
    "renamed": ("sft", [{"conv": CHAT["messages"]}, {"conv": []}], "columns: {messages: conv}"),
    "renamed missing": ("sft", [CHAT], "columns: {messages: conv}"),
    "sharegpt speaker": ("sft", [SHAREGPT, {"conversations": [{"from": "alien", "value": "x"}]}],
                         ""),
    "alpaca": ("sft", [{"instruction": "a", "output": "b"}, {"instruction": "a", "output": " "}],
               ""),
    "text": ("sft", [{"text": "a"}, {"text": 3}], "  format: text"),
    "completion": ("sft", [{"prompt": "p", "completion": "c"},
                           {"prompt": "p", "completion": [USER]}], ""),
    "preference mixed prompt": ("dpo", [PAIR, {**PAIR, "prompt": None}], ""),
    "preference earlier null": ("dpo", [{**PAIR, "prompt": None}, PAIR], ""),
    "text prompt not shared": ("dpo", [{"prompt": "zzz", "chosen": [USER, ASSISTANT],
                                        "rejected": [USER, ASSISTANT]}], ""),
    "no shared turn": ("dpo", [{"chosen": [USER, ASSISTANT], "rejected": [USER, ASSISTANT]},
                               {"chosen": [ASSISTANT], "rejected": [USER]}], ""),
    "label": ("classify", [{"text": "a", "label": "pos"}, {"text": "b", "label": 7}],
              "classify:\n  labels: [neg, pos]"),
    "grpo prompt": ("grpo", [{"prompt": "a"}, {"prompt": ""}], "rewards:\n  functions: [rewards.py:r]"),
    "origin column": ("grpo", [{"prompt": "a", "__origin__": 1}],
                      "rewards:\n  functions: [rewards.py:r]"),
    "not an object": ("sft", [CHAT, [1, 2]], ""),
    "surrogate": ("sft", [CHAT, {"messages": [USER, {**ASSISTANT, "content": "\ud800"}]}], ""),
    "nan turn weight": ("sft", [CHAT, '{"messages": [{"role": "user", "content": "a"}, '
                                      '{"role": "assistant", "content": "b", "weight": NaN}]}'], ""),
    "invalid json": ("sft", [CHAT, '{"messages": [}'], ""),
    "deep": ("sft", [CHAT, '{"messages": ' + "[" * 5000 + "]" * 5000 + "}"], ""),
    "deep tools": ("sft", [CHAT, {**CHAT, "tools": [{"a": json.loads("[" * 70 + "]" * 70)}]}],
                   ""),
    "empty": ("sft", [], ""),
    "image part": ("sft", [CHAT, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "a"}, {"type": "image", "image": "cat.png"}]}, ASSISTANT]}], ""),
    "single answer no prompt": ("dpo", [{"chosen": ASSISTANT, "rejected": ASSISTANT}], ""),
    "single answer speaker": ("dpo", [{"conversations": [{"from": "human", "value": "q"}],
                                       "chosen": {"from": "bot", "value": "a"},
                                       "rejected": {"from": "gpt", "value": "b"}}], ""),
    "kto last turn": ("kto", [{**CHAT, "label": True}, {"messages": [ASSISTANT, USER],
                                                         "label": False}], ""),
    "tools not json": ("sft", [{**SHAREGPT, "tools": "[]"}, {**SHAREGPT, "tools": "[{name"}], ""),
    "function_call not json": ("sft", [{"conversations": [
        {"from": "human", "value": "q"}, {"from": "function_call", "value": "f(x)"},
        {"from": "observation", "value": "1"}, {"from": "gpt", "value": "a"}]}], ""),
    "function_call no name": ("sft", [{"conversations": [
        {"from": "human", "value": "q"}, {"from": "function_call", "value": '{"arguments": {}}'},
        {"from": "gpt", "value": "a"}]}], ""),
    "mapped alpaca input": ("sft", [{"instruction": "a", "input": "x", "output": "b"},
                                    {"instruction": "a", "input": 3, "output": "b"}],
                            "columns: {prompt: instruction, completion: output}"),
    "kto label": ("kto", [{**CHAT, "label": True}, {**CHAT, "label": "yes"}], ""),
}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(BAD))
def test_validate_refuses_what_training_refuses_with_the_same_words(write, tmp_path, case):
    from finetune.data.load import load_data

    method, rows, extra = BAD[case]
    path = tmp_path / "rows.jsonl"
    (tmp_path / "rewards.py").write_text("def r(completions, **kwargs):\n    return [0.0]\n")
    path.write_text("".join((r if isinstance(r, str) else json.dumps(r)) + "\n" for r in rows))
    source = f"\n    - path: {path}\n      {extra}" if extra.startswith("columns") else path
    exp = load_experiment(config(write, method, source, "" if source != path else extra))
    with pytest.raises(DataError) as trained:
        load_data(exp)
    with pytest.raises(DataError) as validated:
        check_data(exp)
    # Training counts rows, validate lines; here (no blank lines) they are the same.
    assert str(validated.value).replace(f"{path} line ", f"{path} row ") == \
        str(trained.value).replace(f"{path} line ", f"{path} row ")


def test_data_too_small_is_said_at_validate_and_at_the_start(write, tmp_path):
    """3 rows against a global batch of 8 for 50 steps (133 passes), and 1 eval row: three
    warnings with their numbers, at validate (from the rows it counted) and when the run
    starts (from the rows it loaded); neither stops anything. Enough rows: none."""
    small = jsonl(tmp_path, "small.jsonl", [CHAT] * 3)
    one = jsonl(tmp_path, "one.jsonl", [CHAT])
    extra = (f"  eval: {one}\ntraining: {{max_steps: 50, per_device_train_batch_size: 4, "
             "gradient_accumulation_steps: 2}\n")
    exp = config(write, "sft", small, extra)
    expected = ["data.train: 3 row(s), fewer than one global batch (8: per device x "
                "accumulation x processes): every step repeats rows",
                "data.train: training.max_steps 50 x global batch 8 goes over its 3 row(s) "
                "about 133 times (more than 10)",
                "data.eval: 1 row(s): its metrics say little about the model"]
    validated = run_cli("validate", exp, cwd=tmp_path)
    assert validated.returncode == 0, validated.stderr
    for text in expected:
        assert f"warning: {text}" in validated.stdout, validated.stdout
    started = run_cli("train", exp, "training.max_steps=1", "model.init=random",
                      "evaluation.before_training=false", cwd=tmp_path)
    assert started.returncode == 0, started.stderr[-3000:]
    assert f"finetune: warning: {expected[0]}" in started.stdout
    assert f"finetune: warning: {expected[2]}" in started.stdout
    assert "goes over its" not in started.stdout  # 1 step: under one pass
    # (and chat rows train on the assistant's turns, by default, and the start says so)
    assert "trained tokens: the assistant turns only (training.assistant_only_loss, the " \
           "default for conversations" in started.stdout
    # eval_fraction: the held-out rows are counted as training will hold them out
    enough = jsonl(tmp_path, "enough.jsonl", [CHAT] * 40)
    fine = config(write, "sft", enough, "  eval_fraction: 0.1\ntraining: {max_steps: 20, "
                                        "per_device_train_batch_size: 4}\n")
    validated = run_cli("validate", fine, cwd=tmp_path)
    assert validated.returncode == 0 and "warning" not in validated.stdout, validated.stdout
    assert check_data(load_experiment(fine))[-1].startswith("data.train[0]: ")


# A tokenizer.chat_template (a file) or a tokenizer without one: chat rows that training
# cannot render. Validate reads the tokenizer's files only; its words are training's.
TEMPLATES = {
    "no template": None,
    "syntax error": "{% for m in messages %}{{ m.content }{% endfor %}",
    "fails to render": "{{ bos_token }}{% for m in messages %}{{ raise_exception('no ' "
                       "+ m.role) }}{% endfor %}",
    # renders rows 1 and 2, not row 3's system turn in the middle: validate renders every row
    "fails on row 3": "{{ bos_token }}{% for m in messages %}{% if m.role == 'system' and not "
                      "loop.first %}{{ raise_exception('a system turn comes first') }}{% endif %}"
                      "{{ m.content + eos_token }}{% endfor %}",
}
LATE_SYSTEM = {"messages": [USER, {"role": "system", "content": "be brief"}, ASSISTANT]}


@pytest.mark.slow
@pytest.mark.parametrize("case", sorted(TEMPLATES))
def test_validate_refuses_chat_rows_training_cannot_render(write, tmp_path, case):
    from finetune.data.prepare import prepare
    from finetune.methods import preparation
    from finetune.model.tokenizer import load_tokenizer

    tokenizer = tmp_path / "tokenizer"
    tokenizer.mkdir()
    for part in TINY_MODEL.iterdir():
        (tokenizer / part.name).write_bytes(part.read_bytes())
    settings = json.loads((tokenizer / "tokenizer_config.json").read_text())
    extra = "tokenizer:\n  name_or_path: tokenizer\n"
    if TEMPLATES[case] is None:
        del settings["chat_template"]
    else:
        (tmp_path / "chat.jinja").write_text(TEMPLATES[case])
        extra += "  chat_template: chat.jinja\n"
    (tokenizer / "tokenizer_config.json").write_text(json.dumps(settings))
    path = jsonl(tmp_path, "chat.jsonl", [CHAT] * 2 + [LATE_SYSTEM])
    exp = load_experiment(config(write, "sft", path, extra))
    with pytest.raises(DataError) as trained:
        prepare(exp, load_tokenizer(exp), preparation(exp))
    result = run_cli("validate", str(tmp_path / "exp.yaml"), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert result.stderr.replace(f"{path} line ", f"{path} row ") == f"error: {trained.value}\n"
    if case == "fails on row 3":
        assert str(trained.value).startswith(f"{path} row 3: the chat template cannot render "
                                             "it (TemplateError: a system turn comes first)")
