"""Rows as other tools write them (data/peer_rows.py): OpenAI's content parts, LLaMA-Factory's
single-message preference answers and its kto conversations with a boolean label; each read
as its authors mean it, or refused naming file, row and what is wrong."""

from __future__ import annotations

import json

import pytest

from conftest import TINY_MODEL, run_cli, jsonl, turn
from finetune.config import load_experiment
from finetune.data.load import load_data


def experiment(write, method, train, extra=""):
    return write("exp.yaml", f"method: {method}\nmodel:\n  name_or_path: {TINY_MODEL}\n"
                             f"data:\n  train: {train}\n{extra}")


def parts(*texts):
    return [{"type": "text", "text": t} for t in texts]


def test_text_content_parts_are_joined_by_newlines(write, tmp_path):
    rows = [{"messages": [turn("user", parts("look", "here")), turn("assistant", parts("ok"))]},
            {"messages": [turn("user", parts("q")), turn("assistant", parts("a", "b"))]}]
    path = jsonl(tmp_path, "parts.jsonl", rows)
    splits = load_data(load_experiment(experiment(write, "sft", path)))
    assert splits.train[0]["messages"] == [turn("user", "look\nhere"), turn("assistant", "ok")]
    assert splits.train[1]["messages"][1] == turn("assistant", "a\nb")
    assert f"{path}: 4 message(s) gave their content as parts" in splits.notes[0]


@pytest.mark.slow  # a CLI process
def test_an_image_part_is_refused_at_validate_naming_the_row(write, tmp_path):
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    rows = [{"messages": [turn("user", parts("hi")), turn("assistant", "yo")]},
            {"messages": [turn("user", parts("what is it?") + [image]), turn("assistant", "a cat")]}]
    path = jsonl(tmp_path, "img.jsonl", rows)
    result = run_cli("validate", str(experiment(write, "sft", path)), cwd=tmp_path)
    assert result.returncode == 2, result.stdout
    assert f"{path} line 2: `messages[0].content[1]` is a part of type 'image_url': this " \
           "model and data format take text parts only" in result.stderr


# LLaMA-Factory's dpo_en_demo row: a sharegpt prompt, each answer one {from, value} message.
FACTORY_DPO = {"conversations": [{"from": "human", "value": "sort: b a"}],
               "chosen": {"from": "gpt", "value": "a b"},
               "rejected": {"from": "gpt", "value": "b a"}}


def test_single_message_answers_are_read_after_the_prompt(write, tmp_path):
    openai = {"messages": [turn("user", "q")], "chosen": turn("assistant", "good"),
              "rejected": turn("assistant", parts("bad"))}
    factory = jsonl(tmp_path, "factory.jsonl", [FACTORY_DPO] * 2)
    splits = load_data(load_experiment(experiment(write, "dpo", factory)))
    assert splits.train[0]["prompt"] == [turn("user", "sort: b a")]
    assert splits.train[0]["chosen"] == [turn("assistant", "a b")]
    assert splits.train[0]["rejected"] == [turn("assistant", "b a")]
    assert "`chosen`/`rejected` given as one message each (2 row(s))" in splits.notes[0]
    other = jsonl(tmp_path, "openai.jsonl", [openai])
    splits = load_data(load_experiment(experiment(write, "dpo", other)))
    assert (splits.train[0]["prompt"], splits.train[0]["rejected"]) == \
        ([turn("user", "q")], [turn("assistant", "bad")])


# LLaMA-Factory's kto_en_demo row: a conversation and whether its last answer is desirable.
FACTORY_KTO = [{"messages": [turn("user", "hi"), turn("assistant", "hello"),
                             turn("user", "sort: b a"), turn("assistant", "a b")], "label": True},
               {"messages": [turn("user", "sort: d c"), turn("assistant", "d c")], "label": False}]


def test_kto_conversations_with_a_label_are_unpaired_rows(write, tmp_path):
    path = jsonl(tmp_path, "kto.jsonl", FACTORY_KTO)
    splits = load_data(load_experiment(experiment(write, "kto", path)))
    assert splits.format == "unpaired_preference"
    row = splits.train[0]
    assert row["prompt"] == FACTORY_KTO[0]["messages"][:3]
    assert (row["completion"], row["label"]) == ([turn("assistant", "a b")], True)
    assert splits.train[1]["label"] is False
    assert "labelled_messages rows read as unpaired rows" in splits.notes[0]


# LLaMA-Factory's glaive_toolcall rows: bare function schemas as JSON text, a call as JSON
# text (one, or a list), the tool's answer as an observation. The two rows give `ingredients`
# different types: each row's arguments are its own.
RECIPES = {"name": "search_recipes", "description": "Find recipes", "parameters": {
    "type": "object", "properties": {"ingredients": {"type": "array"}}, "required": ["ingredients"]}}
CLOCK = {"name": "clock", "description": "The time", "parameters": {
    "type": "object", "properties": {"zone": {"type": "string"}}}}
GLAIVE = [
    {"conversations": [
        {"from": "human", "value": "A recipe with chicken?"},
        {"from": "function_call", "value": json.dumps(
            {"name": "search_recipes", "arguments": {"ingredients": ["chicken"]}})},
        {"from": "observation", "value": json.dumps({"recipes": ["Chicken soup"]})},
        {"from": "gpt", "value": "I found Chicken soup."}],
     "tools": json.dumps([RECIPES])},
    {"conversations": [
        {"from": "human", "value": "Time in UTC and a rice recipe?"},
        {"from": "function_call", "value": json.dumps([
            {"name": "clock", "arguments": {"zone": "UTC"}},
            {"name": "search_recipes", "arguments": {"ingredients": "rice"}}])},
        {"from": "observation", "value": "12:00"},
        {"from": "observation", "value": "Rice pudding"},
        {"from": "gpt", "value": "Noon; rice pudding."}],
     "tools": json.dumps([CLOCK, RECIPES])},
]


def call(name, arguments):
    return {"type": "function", "function": {"name": name, "arguments": arguments}}


# The same conversations as OpenAI messages, as a user would write them by hand.
GLAIVE_AS_OPENAI = [
    ([turn("user", "A recipe with chicken?"),
      {"role": "assistant", "tool_calls": [call("search_recipes", {"ingredients": ["chicken"]})]},
      {"role": "tool", "content": json.dumps({"recipes": ["Chicken soup"]}),
       "name": "search_recipes"},
      turn("assistant", "I found Chicken soup.")], [RECIPES]),
    ([turn("user", "Time in UTC and a rice recipe?"),
      {"role": "assistant", "tool_calls": [call("clock", {"zone": "UTC"}),
                                           call("search_recipes", {"ingredients": "rice"})]},
      {"role": "tool", "content": "12:00", "name": "clock"},
      {"role": "tool", "content": "Rice pudding", "name": "search_recipes"},
      turn("assistant", "Noon; rice pudding.")], [CLOCK, RECIPES]),
]


def tool_tokenizer(write, path, template):
    from finetune.model.tokenizer import load_tokenizer

    exp = load_experiment(experiment(write, "sft", path, f"tokenizer:\n  chat_template: "
                                                          f"{json.dumps(template)}\n"))
    return exp, load_tokenizer(exp)


def test_sharegpt_tool_calls_render_and_train_as_openai_tool_calls(write, tmp_path):
    from test_formats import TOOL_TEMPLATE
    from finetune.data import sft_tokens

    path = jsonl(tmp_path, "glaive.jsonl", GLAIVE)
    exp, tokenizer = tool_tokenizer(write, path, TOOL_TEMPLATE)
    splits = load_data(exp)
    assert "in 2 row(s) function_call turns as assistant tool calls" in splits.notes[0]
    tokens = sft_tokens.tokenize(splits.train, tokenizer, "messages",
                                 sft_tokens.Masking(assistant_only=True), "train")
    for (messages, tools), row in zip(GLAIVE_AS_OPENAI, tokens):
        # Independently: the template's own assistant mask on the OpenAI form.
        expected = tokenizer.apply_chat_template(
            messages, tools=[{"type": "function", "function": t} for t in tools],
            tokenize=True, return_dict=True, return_assistant_tokens_mask=True)
        assert row["input_ids"] == expected["input_ids"]
        trained = [t for t, m in zip(expected["input_ids"], expected["assistant_masks"]) if m]
        assert [t for t in row["labels"] if t != -100] == trained
    text = tokenizer.decode(tokens[1]["input_ids"])
    assert 'call clock {"zone": "UTC"}call search_recipes {"ingredients": "rice"}' in text
    assert '"name": "clock"' in text  # the tools, wrapped as {type: function, function}
    trained_text = tokenizer.decode([t for t in tokens[1]["labels"] if t != -100])
    assert "call clock" in trained_text and "Rice pudding" not in trained_text


@pytest.mark.parametrize("dropped,problem", [
    ("'<|user|>result: ' + message['content'] + '<|end|>'",
     "the chat template leaves out `messages[2]` (a tool result)"),
    ("'<|system|>tools: ' + (tools | tojson) + '<|end|>'",
     "the chat template renders no `tools` (the row's function schemas would be lost)")],
    ids=["tool results", "tools"])
def test_a_template_that_drops_tool_parts_is_refused_naming_the_row(write, tmp_path, dropped,
                                                                     problem):
    from test_formats import TOOL_TEMPLATE
    from finetune.data import sft_tokens
    from finetune.errors import DataError

    mute = TOOL_TEMPLATE.replace(dropped, "''")
    assert mute != TOOL_TEMPLATE
    path = jsonl(tmp_path, "glaive.jsonl", GLAIVE)
    exp, tokenizer = tool_tokenizer(write, path, mute)
    splits = load_data(exp)
    try:
        sft_tokens.tokenize(splits.train, tokenizer, "messages", sft_tokens.Masking(), "train")
    except DataError as exc:
        assert str(exc).startswith(f"{path} row 1: {problem}"), str(exc)
    else:
        raise AssertionError("a template that drops tool results was accepted")


@pytest.mark.slow  # a CLI process
def test_finetune_data_shows_sharegpt_tool_calls_trained_and_results_not(write, tmp_path):
    from test_formats import TOOL_TEMPLATE

    path = jsonl(tmp_path, "glaive.jsonl", GLAIVE)
    config = experiment(write, "sft", path, f"tokenizer:\n  chat_template: "
                                            f"{json.dumps(TOOL_TEMPLATE)}\n")
    result = run_cli("data", str(config), "-n", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "function_call turns as assistant tool calls" in result.stdout
    assert '<|assistant|>⟦ call search_recipes {"ingredients": ["chicken"]}<|eos|>⟧<|user|> ' \
           'result: {"recipes": ["Chicken soup"]}<|end|><|assistant|>⟦ I found Chicken soup.' \
           in result.stdout


def test_alpaca_input_under_a_hand_mapping_is_joined_as_alpaca_does(write, tmp_path):
    rows = [{"instruction": "Sort the words.", "input": "b a", "output": "a b"},
            {"instruction": "Say hi.", "input": "", "output": "hi"}]
    path = jsonl(tmp_path, "alpaca.jsonl", rows)
    source = f"\n    - path: {path}\n      columns: {{prompt: instruction, completion: output}}"
    splits = load_data(load_experiment(experiment(write, "sft", source)))
    assert splits.format == "prompt_completion"
    assert splits.train["prompt"] == ["Sort the words.\n\nb a", "Say hi."]
    assert splits.notes == [f"{path}: columns maps `prompt` from alpaca's `instruction`: the "
                            "`input` of 1 row(s) joined to it after a blank line, as alpaca does"]
