"""Rows as other tools write them (data/peer_rows.py): OpenAI's content parts, LLaMA-Factory's
single-message preference answers and its kto conversations with a boolean label; each read
as its authors mean it, or refused naming file, row and what is wrong."""

from __future__ import annotations

import json

from conftest import TINY_MODEL, run_cli
from finetune.config import load_experiment
from finetune.data.load import load_data


def experiment(write, method, train, extra=""):
    return write("exp.yaml", f"method: {method}\nmodel:\n  name_or_path: {TINY_MODEL}\n"
                             f"data:\n  train: {train}\n{extra}")


def jsonl(tmp_path, name, rows):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def turn(role, content):
    return {"role": role, "content": content}


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


def test_an_image_part_is_refused_at_validate_naming_the_row(write, tmp_path):
    image = {"type": "image_url", "image_url": {"url": "http://x/cat.png"}}
    rows = [{"messages": [turn("user", parts("hi")), turn("assistant", "yo")]},
            {"messages": [turn("user", parts("what is it?") + [image]), turn("assistant", "a cat")]}]
    path = jsonl(tmp_path, "img.jsonl", rows)
    result = run_cli("validate", str(experiment(write, "sft", path)), cwd=tmp_path)
    assert result.returncode == 2, result.stdout
    assert f"{path} line 2: `messages[0].content[1]` is a 'image_url' part: this model and " \
           "data format take text only" in result.stderr


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
