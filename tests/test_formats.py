"""Rows in the schemas of public datasets: preference rows with a text prompt before
message lists, alpaca, sharegpt; auto-detection, data.format, data.roles, and the error of a
row that fits no format (which formats were tried, and why each failed)."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_MODEL, run_cli, jsonl, turn
from finetune.config import load_experiment
from finetune.data.load import ORIGIN, load_data
from finetune.errors import ConfigError, DataError


def experiment(write, method, train, extra=""):
    return load_experiment(write("exp.yaml", f"method: {method}\nmodel:\n  name_or_path: "
                                             f"{TINY_MODEL}\ndata:\n  train: {train}\n{extra}"))


def ultrafeedback(i):
    """A row in the schema of the most used public preference sets: the prompt as text,
    chosen and rejected as the whole conversation, score and id columns besides."""
    prompt = f"sort: w{i} a b"
    return {"prompt": prompt, "prompt_id": f"id{i}", "score_chosen": 8.0, "score_rejected": 3.5,
            "chosen": [turn("user", prompt), turn("assistant", f"a b w{i}")],
            "rejected": [turn("user", prompt), turn("assistant", f"w{i} b a")]}


def answers_only(i):
    """The text prompt, and only the answers as messages."""
    return {"prompt": f"sort: w{i} a b", "chosen": [turn("assistant", f"a b w{i}")],
            "rejected": [turn("assistant", f"w{i} b a")]}


@pytest.mark.parametrize("method", ["reward", "dpo"])
def test_text_prompt_before_full_conversations_is_the_shared_turns(write, tmp_path, method):
    path = jsonl(tmp_path, "uf.jsonl", [ultrafeedback(i) for i in range(3)])
    splits = load_data(experiment(write, method, path))
    row = splits.train[1]
    assert row["prompt"] == [turn("user", "sort: w1 a b")]
    assert row["chosen"] == [turn("assistant", "a b w1")]
    assert row["rejected"] == [turn("assistant", "w1 b a")]
    assert set(splits.train.column_names) == {"prompt", "chosen", "rejected", ORIGIN}
    assert splits.notes == [f"{path}: `prompt` given as text, `chosen`/`rejected` as messages: "
                            "the prompt used is the turns chosen and rejected share (TRL's "
                            "implicit prompt) (3 row(s))"]


@pytest.mark.parametrize("method", ["reward", "dpo"])
def test_text_prompt_before_answers_is_the_user_turn(write, tmp_path, method):
    path = jsonl(tmp_path, "a.jsonl", [answers_only(i) for i in range(2)])
    splits = load_data(experiment(write, method, path))
    assert splits.train[0]["prompt"] == [turn("user", "sort: w0 a b")]
    assert splits.train[0]["chosen"] == [turn("assistant", "a b w0")]
    assert "the prompt used is the text as the user turn (2 row(s))" in splits.notes[0]


def test_text_prompt_that_contradicts_the_shared_turns_is_refused(write, tmp_path):
    other = {**ultrafeedback(1), "prompt": "something else entirely"}
    path = jsonl(tmp_path, "c.jsonl", [ultrafeedback(0), other])
    with pytest.raises(DataError) as info:
        load_data(experiment(write, "dpo", path))
    assert str(info.value).startswith(
        f"{path} row 2: `prompt` is text that none of the leading turns `chosen` and "
        "`rejected` share contains"), str(info.value)


def test_empty_text_prompt_before_answers_is_refused(write, tmp_path):
    path = jsonl(tmp_path, "e.jsonl", [answers_only(0), {**answers_only(1), "prompt": " "}])
    with pytest.raises(DataError, match=rf"{path} row 2: `prompt` is empty"):
        load_data(experiment(write, "reward", path))


ALPACA = [{"instruction": "Sort the words.", "input": "b a", "output": "a b"},
          {"instruction": "Say hi.", "input": "", "output": "hi", "system": "Be brief."}]


def test_alpaca_is_prompt_completion_messages_for_sft(write, tmp_path):
    path = jsonl(tmp_path, "alpaca.jsonl", ALPACA)
    splits = load_data(experiment(write, "sft", path))
    assert splits.format == "prompt_completion"
    assert splits.train[0]["prompt"] == [turn("user", "Sort the words.\n\nb a")]
    assert splits.train[0]["completion"] == [turn("assistant", "a b")]
    assert splits.train[1]["prompt"] == [turn("system", "Be brief."), turn("user", "Say hi.")]
    assert "alpaca rows read as prompt/completion messages" in splits.notes[0]


def test_alpaca_is_a_prompt_for_grpo_with_other_columns_kept(write, tmp_path):
    path = jsonl(tmp_path, "alpaca.jsonl", ALPACA)
    (tmp_path / "rf.py").write_text("def f(completions, **kw):\n    return [0.0] * len(completions)\n")
    splits = load_data(experiment(write, "grpo", path, "rewards:\n  functions: [rf.py:f]\n"))
    assert splits.format == "prompt"
    assert splits.train[0]["prompt"] == [turn("user", "Sort the words.\n\nb a")]
    assert splits.train[0]["output"] == "a b"  # for the reward functions


def test_alpaca_is_not_read_by_preference_methods(write, tmp_path):
    with pytest.raises(ConfigError, match="data.format: method dpo takes auto, preference"):
        experiment(write, "dpo", jsonl(tmp_path, "a.jsonl", ALPACA), "  format: alpaca\n")


def test_alpaca_row_problems_name_file_and_row(write, tmp_path):
    path = jsonl(tmp_path, "alpaca.jsonl", ALPACA + [{"instruction": "x", "output": 3}])
    with pytest.raises(DataError) as info:
        load_data(experiment(write, "sft", path))
    assert str(info.value).startswith(f"{path} row 3: `output` must be text, got int (read as "
                                      "alpaca; tried messages: missing `messages`;")


SHAREGPT = [{"conversations": [{"from": "system", "value": "Be brief."},
                               {"from": "human", "value": "hi"}, {"from": "gpt", "value": "yo"},
                               {"from": "human", "value": "again"},
                               {"from": "gpt", "value": "yo yo"}]},
            {"conversations": [{"from": "user", "value": "q"}, {"from": "bot", "value": "a"}]}]


def test_sharegpt_with_a_role_map_is_messages(write, tmp_path):
    path = jsonl(tmp_path, "sharegpt.jsonl", SHAREGPT)
    splits = load_data(experiment(write, "sft", path, "  roles: {bot: assistant}\n"))
    assert splits.format == "messages"
    assert splits.train[0]["messages"] == [
        turn("system", "Be brief."), turn("user", "hi"), turn("assistant", "yo"),
        turn("user", "again"), turn("assistant", "yo yo")]
    assert splits.train[1]["messages"] == [turn("user", "q"), turn("assistant", "a")]


def test_sharegpt_unknown_speaker_names_the_setting(write, tmp_path):
    path = jsonl(tmp_path, "sharegpt.jsonl", SHAREGPT)
    with pytest.raises(DataError) as info:
        load_data(experiment(write, "sft", path, "  format: sharegpt\n"))
    assert str(info.value) == (f"{path} row 2: `conversations[1].from` is 'bot', not a known "
                               "speaker: map it to a role with data.roles (data.format sharegpt)")


def test_roles_must_map_to_known_roles(write, tmp_path):
    with pytest.raises(ConfigError, match="data.roles: .*bot: 'robot': a role is one of "
                                          "system, user, assistant, tool"):
        experiment(write, "sft", jsonl(tmp_path, "s.jsonl", SHAREGPT),
                   "  roles: {bot: robot}\n")


def test_forced_format_needs_its_columns(write, tmp_path):
    path = jsonl(tmp_path, "alpaca.jsonl", ALPACA)
    with pytest.raises(DataError, match=rf"{path}: format sharegpt needs column\(s\) "
                                        "conversations; found instruction, input, output"):
        load_data(experiment(write, "sft", path, "  format: sharegpt\n"))


def test_row_fitting_no_format_says_what_was_tried(write, tmp_path):
    chat = {"messages": [turn("user", "x"), turn("assistant", "y")]}
    sharegpt_turns = {"messages": [{"from": "human", "value": "x"}]}
    path = jsonl(tmp_path, "chat.jsonl", [chat, sharegpt_turns])
    with pytest.raises(DataError) as info:
        load_data(experiment(write, "sft", path))
    assert str(info.value) == (
        f"{path} row 2: `messages[0]` must have `role` and `content` (read as messages; tried "
        "prompt_completion: missing `prompt`; text: missing `text`; alpaca: missing "
        "`instruction`; sharegpt: missing `conversations`)")


def test_file_fitting_no_format_lists_every_format(write, tmp_path):
    path = jsonl(tmp_path, "x.jsonl", [{"question": "q"}])
    with pytest.raises(DataError) as info:
        load_data(experiment(write, "sft", path))
    assert str(info.value) == (
        f"{path}: method sft needs columns messages or prompt/completion or text or "
        "instruction/output (alpaca) or conversations "
        "(sharegpt); found question (rename with data.<split>[i].columns)")


def training(method, train, extra=""):
    return (f"method: {method}\nmodel: {{name_or_path: {TINY_MODEL}, init: random}}\n"
            f"data:\n  train: {train}\n{extra}evaluation: {{before_training: false}}\n"
            "output: {plot: false}\ntraining:\n  max_steps: 2\n  per_device_train_batch_size: 4\n"
            "  logging_steps: 1\n  save_strategy: 'no'\n  max_length: 64\n")


def trained(result, run):
    assert result.returncode == 0, result.stderr[-3000:]
    losses = [json.loads(line).get("loss") for line in (run / "metrics.jsonl").read_text()
              .splitlines()]
    assert len([x for x in losses if x is not None]) == 2


@pytest.mark.slow
@pytest.mark.parametrize("method", ["reward", "dpo"])
def test_public_preference_schema_trains(method, write, tmp_path):
    rows = [ultrafeedback(i) for i in range(4)] + [answers_only(i) for i in range(4)]
    data = jsonl(tmp_path, "prefs.jsonl", rows)
    config = write(f"{method}.yaml", training(method, data))
    result = run_cli("train", str(config), cwd=tmp_path)
    trained(result, tmp_path / "runs" / method)
    assert "the prompt used is the turns chosen and rejected share (TRL's implicit prompt) " \
           "(4 row(s)) and the text as the user turn (4 row(s))" in result.stdout


@pytest.mark.slow
@pytest.mark.parametrize("name,rows,extra", [
    ("alpaca", ALPACA * 4, ""), ("sharegpt", SHAREGPT * 4, "  roles: {bot: assistant}\n")])
def test_alpaca_and_sharegpt_train_sft(name, rows, extra, write, tmp_path):
    data = jsonl(tmp_path, f"{name}.jsonl", rows)
    config = write(f"{name}.yaml", training("sft", data, extra))
    result = run_cli("train", str(config), cwd=tmp_path)
    trained(result, tmp_path / "runs" / name)
    assert f"{name} rows read as" in result.stdout


@pytest.mark.slow
def test_train_refuses_a_contradicting_preference_prompt_with_file_and_row(write, tmp_path):
    data = jsonl(tmp_path, "c.jsonl", [{**ultrafeedback(0), "prompt": "other"}])
    config = write("dpo.yaml", training("dpo", data))
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"error: {data} row 1: `prompt` is text that none of the leading turns" \
        in result.stderr


# A chat template that renders tools and tool calls, with {% generation %} around what the
# assistant says (its tool calls included), as tool-calling models' templates do.
TOOL_TEMPLATE = (
    "{{ bos_token }}{% if tools %}{{ '<|system|>tools: ' + (tools | tojson) + '<|end|>' }}"
    "{% endif %}{% for message in messages %}{% if message['role'] == 'user' %}"
    "{{ '<|user|>' + message['content'] + '<|end|>' }}{% elif message['role'] == 'tool' %}"
    "{{ '<|user|>result: ' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' }}{% generation %}"
    "{% if message.tool_calls %}{% for call in message.tool_calls %}"
    "{{ 'call ' + call.function.name + ' ' + (call.function.arguments | tojson) }}"
    "{% endfor %}{% else %}{{ message['content'] }}{% endif %}{{ eos_token }}"
    "{% endgeneration %}{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}")

WEATHER = {"type": "function", "function": {"name": "weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}}}}}
CLOCK = {"type": "function", "function": {"name": "clock", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}}
TOOL_ROWS = [
    {"tools": [WEATHER], "messages": [
        turn("user", "rain in Oslo?"),
        {"role": "assistant", "tool_calls": [{"type": "function", "function": {
            "name": "weather", "arguments": {"city": "Oslo"}}}]},
        {"role": "tool", "content": "rain", "name": "weather"},
        turn("assistant", "yes, rain")]},
    {"tools": [CLOCK], "messages": [
        turn("user", "time in UTC?"),
        {"role": "assistant", "content": None, "tool_calls": [{"type": "function", "function": {
            "name": "clock", "arguments": {"zone": "UTC"}}}]},
        {"role": "tool", "content": "12:00"}, turn("assistant", "noon")]},
]


@pytest.mark.slow
def test_tool_calls_are_rendered_and_trained_as_assistant_turns(write, tmp_path):
    from finetune.methods import sft
    from finetune.model.tokenizer import load_tokenizer

    path = jsonl(tmp_path, "tools.jsonl", TOOL_ROWS)
    template = json.dumps(TOOL_TEMPLATE)
    exp = experiment(write, "sft", path, f"tokenizer:\n  chat_template: {template}\n"
                                         "training:\n  assistant_only_loss: true\n")
    tokenizer = load_tokenizer(exp)
    splits = load_data(exp)
    assert splits.format == "messages" and "tools" in splits.train.column_names
    prepared = sft.prepare(splits, tokenizer, exp)
    for row, tokens in zip(TOOL_ROWS, prepared.train):
        # Independently: the template's own assistant mask on the rows as written.
        expected = tokenizer.apply_chat_template(
            row["messages"], tools=row["tools"], tokenize=True, return_dict=True,
            return_assistant_tokens_mask=True)
        assert tokens["input_ids"] == expected["input_ids"]
        trained = [t for t, m in zip(expected["input_ids"], expected["assistant_masks"]) if m]
        assert [t for t in tokens["labels"] if t != -100] == trained
    text = tokenizer.decode(prepared.train[1]["input_ids"])
    # The second row's tools as given: no null keys from the first row's schema.
    assert '"name": "clock"' in text and "null" not in text and "weather" not in text
    trained_text = tokenizer.decode([t for t in prepared.train[0]["labels"] if t != -100])
    assert 'call weather {"city": "Oslo"}' in trained_text and "rain in Oslo" not in trained_text


@pytest.mark.parametrize("message,problem", [
    ({"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]},
     "`messages[1].tool_calls` is on a user message; only assistant turns call tools"),
    ({"role": "assistant", "tool_calls": [{"function": {"arguments": {}}}]},
     "`messages[1].tool_calls[0]` must have `function` with a `name`"),
])
def test_bad_tool_calls_name_file_and_row(write, tmp_path, message, problem):
    row = {"messages": [turn("user", "q"), message, turn("assistant", "a")]}
    path = jsonl(tmp_path, "t.jsonl", [TOOL_ROWS[0], row])
    with pytest.raises(DataError) as info:
        load_data(experiment(write, "sft", path))
    assert str(info.value).startswith(f"{path} row 2: {problem}"), str(info.value)


@pytest.mark.slow
def test_a_template_without_tool_support_names_the_row(write, tmp_path):
    from finetune.methods import sft
    from finetune.model.tokenizer import load_tokenizer

    path = jsonl(tmp_path, "tools.jsonl", TOOL_ROWS)
    exp = experiment(write, "sft", path)  # tiny-llama's template knows no tool calls
    with pytest.raises(DataError, match=rf"{path} row 1: the chat template cannot render it"):
        sft.prepare(load_data(exp), load_tokenizer(exp), exp)
