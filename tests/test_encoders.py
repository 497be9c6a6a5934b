"""Backbones outside the causal-LM family: a tiny BERT-style encoder (no EOS token, no chat
template), built here from a config and a WordPiece vocabulary, trains `reward` and
`classify` on plain text; chat rows without a template, and a model with custom code
while trust_remote_code is off, are one-line errors."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from conftest import run_cli

# One worker runs this module: its module fixture (bert) trains once, not once per worker.
pytestmark = pytest.mark.xdist_group("encoders")

WORDS = ("apple bread cat dog egg fish goat hat ice jam kite lamp moon nut owl pig queen "
         "rose sun tree van yak zebra good bad").split()


@pytest.fixture(scope="module")
def bert(tmp_path_factory) -> Path:
    from transformers import BertConfig, BertTokenizerFast

    folder = tmp_path_factory.mktemp("tiny-bert")
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *WORDS]
    (folder / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(folder / "vocab.txt"))
    assert tokenizer.eos_token is None and tokenizer.chat_template is None
    tokenizer.save_pretrained(folder)
    BertConfig(vocab_size=len(vocab), hidden_size=32, num_hidden_layers=2,
               num_attention_heads=2, intermediate_size=64,
               max_position_embeddings=64).save_pretrained(folder)
    return folder


def _jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    return path


def _experiment(write, method: str, model: Path, data: Path, extra: str = "") -> Path:
    return write(f"{method}.yaml", f"method: {method}\nmodel:\n  name_or_path: {model}\n"
                 f"  init: random\ndata:\n  train: {data}\n{extra}training:\n  max_steps: 2\n"
                 "  per_device_train_batch_size: 4\n  logging_steps: 1\n  save_steps: 2\n")


def _losses(run: Path) -> list[float]:
    records = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    return [r["loss"] for r in records if "loss" in r]


@pytest.mark.slow
def test_an_encoder_trains_a_reward_model_on_plain_text(bert, write, tmp_path):
    data = _jsonl(tmp_path / "pairs.jsonl",
                  [{"prompt": "sort ", "chosen": "apple bread cat", "rejected": "cat bread apple"},
                   {"prompt": "sort ", "chosen": "egg fish", "rejected": "fish egg"}] * 4)
    result = run_cli("train", str(_experiment(write, "reward", bert, data)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    assert "no EOS appended to plain texts" in result.stdout  # the choice, said
    losses = _losses(tmp_path / "runs" / "reward")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


@pytest.mark.slow
def test_an_encoder_trains_a_classifier_on_plain_text(bert, write, tmp_path):
    data = _jsonl(tmp_path / "texts.jsonl", [{"text": "apple bread cat", "label": "good"},
                                             {"text": "zebra yak van", "label": "bad"}] * 4)
    config = _experiment(write, "classify", bert, data, "classify:\n  labels: [good, bad]\n")
    result = run_cli("train", str(config), cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-3000:]
    losses = _losses(tmp_path / "runs" / "classify")
    assert len(losses) == 2 and all(math.isfinite(x) for x in losses)


def _in_process(config: Path, tmp_path: Path, capsys, monkeypatch) -> list[str]:
    """`finetune train CONFIG` through the CLI's own main: exit 2 and its error lines."""
    from finetune.cli import main

    monkeypatch.chdir(tmp_path)
    assert main(["train", str(config)]) == 2
    return [line for line in capsys.readouterr().err.splitlines() if line.startswith("error:")]


def test_chat_rows_without_a_chat_template_are_one_error(bert, write, tmp_path, capsys,
                                                        monkeypatch):
    data = _jsonl(tmp_path / "chat.jsonl",
                  [{"chosen": [{"role": "user", "content": "cat"}],
                    "rejected": [{"role": "user", "content": "dog"}]}] * 2)
    errors = _in_process(_experiment(write, "reward", bert, data), tmp_path, capsys,
                         monkeypatch)
    assert len(errors) == 1 and str(data) in errors[0]
    assert "no chat template" in errors[0] and "tokenizer.chat_template" in errors[0]


def test_a_template_that_cannot_render_the_rows_is_one_error(bert, write, tmp_path, capsys,
                                                             monkeypatch):
    data = _jsonl(tmp_path / "chat.jsonl",
                  [{"chosen": [{"role": "user", "content": "cat"}],
                    "rejected": [{"role": "user", "content": "dog"}]}] * 2)
    broken = "{% for m in messages %}{{ m.content }{% endfor %}"  # a Jinja syntax error
    config = _experiment(write, "reward", bert, data,
                         f"tokenizer:\n  chat_template: {json.dumps(broken)}\n")
    errors = _in_process(config, tmp_path, capsys, monkeypatch)
    assert len(errors) == 1 and f"{data} row 1, `chosen`" in errors[0]
    assert "chat template cannot render" in errors[0] and "TemplateSyntaxError" in errors[0]


def _custom(bert: Path, folder: Path, file: str) -> Path:
    folder.mkdir()
    for part in bert.iterdir():
        (folder / part.name).write_bytes(part.read_bytes())
    content = json.loads((folder / file).read_text())
    content["auto_map"] = {"AutoConfig": "modeling_custom.CustomConfig"}
    (folder / file).write_text(json.dumps(content))
    return folder


def test_custom_code_without_trust_remote_code_is_one_line(bert, write, tmp_path, capsys,
                                                           monkeypatch):
    model = _custom(bert, tmp_path / "custom", "config.json")
    data = _jsonl(tmp_path / "texts.jsonl", [{"text": "cat", "label": "good"}] * 2)
    config = _experiment(write, "classify", model, data, "classify:\n  labels: [good, bad]\n")
    errors = _in_process(config, tmp_path, capsys, monkeypatch)
    assert len(errors) == 1 and "model.name_or_path" in errors[0] and str(model) in errors[0]
    assert "model.trust_remote_code" in errors[0]


def test_a_custom_tokenizer_is_refused_before_loading(bert, tmp_path):
    from finetune.model.tokenizer import load_tokenizer
    from finetune.config.schema import Experiment
    from finetune.errors import RunError

    model = _custom(bert, tmp_path / "custom", "tokenizer_config.json")
    experiment = Experiment.model_validate(
        {"name": "custom", "method": "classify", "model": {"name_or_path": str(model)},
         "data": {"train": "x.jsonl"}, "classify": {"labels": ["a", "b"]}})
    with pytest.raises(RunError, match="model.trust_remote_code is false"):
        load_tokenizer(experiment)


@pytest.mark.slow
def test_encoder_pairs_are_framed_once_whatever_the_text(bert):
    """Any plain text, prompt or none: one [CLS] first and one [SEP] last, no EOS added."""
    from datasets import Dataset
    from hypothesis import given, settings, strategies as st
    from transformers import AutoTokenizer

    from finetune.methods.reward import _tokenized

    tokenizer = AutoTokenizer.from_pretrained(bert)
    cls, sep = tokenizer.cls_token_id, tokenizer.sep_token_id
    text = st.text(max_size=40) | st.lists(st.sampled_from(WORDS), max_size=8).map(" ".join)

    @settings(max_examples=60, deadline=None, derandomize=True)
    @given(prompt=text, chosen=text, rejected=text)
    def check(prompt, chosen, rejected):
        rows = Dataset.from_list([{"prompt": prompt, "chosen": chosen, "rejected": rejected}])
        row = _tokenized(rows, tokenizer, None)[0]
        for ids in (row["chosen_ids"], row["rejected_ids"]):
            assert ids[0] == cls and ids[-1] == sep
            assert ids.count(sep) == 1 and ids.count(cls) == 1

    check()
