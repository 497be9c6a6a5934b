"""`finetune data`: rows as the model gets them with the trained tokens marked, token
lengths, and what the max length cuts and drops, as the method's preparation does."""

from __future__ import annotations

import json
import re

import pytest

from conftest import TINY_MODEL, run_cli


def rows(path, items):
    path.write_text("".join(json.dumps(r) + "\n" for r in items))
    return path


def chat(i):
    return {"messages": [{"role": "user", "content": "word " * i},
                         {"role": "assistant", "content": f"answer {i}"}]}


@pytest.mark.slow
def test_data_marks_trained_tokens_and_counts_cut_and_dropped_rows(write, tmp_path):
    data = rows(tmp_path / "chat.jsonl", [chat(i) for i in range(1, 11)])
    config = write("sft.yaml", f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                               f"data: {{train: {data}}}\ntraining: {{max_length: 20}}\n")
    # Conversations train on the assistant's turns by default, and say so. A cold start,
    # which imports the libraries: none of their known noise (run/noise.py) is printed.
    default = run_cli("data", str(config), "-n", "2", cwd=tmp_path, cold=True)
    assert default.returncode == 0, default.stderr[-2000:]
    output = default.stdout + default.stderr
    assert not re.findall(r".*(?:\w+Warning\b|\[WARNING\]|kernels-community).*", output)
    assert "<|bos|><|user|> word <|end|><|assistant|>⟦ answer 1<|eos|>⟧" in default.stdout
    assert "note: trained tokens: the assistant turns only (training.assistant_only_loss, " \
           "the default for conversations; false trains every turn)" in default.stdout
    result = run_cli("data", str(config), "-n", "2", "training.assistant_only_loss=false",
                     cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "data.train: 10 rows" in out and out.count(f"--- {data} row ") == 2
    # assistant_only_loss false: the whole conversation is trained, as TRL's default does.
    assert "⟦<|bos|><|user|> word <|end|><|assistant|> answer 1<|eos|>⟧" in out
    assert "note: trained tokens: every turn, the user's too" in out
    # Only row 1 fits in 20 tokens; the others are cut, and none is dropped, as every
    # token is trained.
    line = next(l for l in out.splitlines() if "training.max_length 20" in l)
    assert line.endswith(": 9 of 10 rows longer: 9 cut, 0 dropped by the method's "
                         "preparation"), line


@pytest.mark.slow
def test_data_counts_rows_that_assistant_only_loss_and_max_length_drop(write, tmp_path):
    data = rows(tmp_path / "chat.jsonl", [chat(i) for i in (1, 30, 30)])
    config = write("sft.yaml", f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                               f"data: {{train: {data}}}\n"
                               "training: {max_length: 16, assistant_only_loss: true}\n")
    result = run_cli("data", str(config), "-n", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    assert "<|user|> word <|end|><|assistant|>⟦ answer 1<|eos|>⟧" in result.stdout
    # The short row is cut too (18 tokens), keeping its answer's start; the long rows'
    # first 16 tokens hold only their user turn: dropped, as training drops them.
    assert "training.max_length 16: 3 of 3 rows longer: 1 cut, 2 dropped by the method's " \
           "preparation" in result.stdout


@pytest.mark.slow
def test_data_reports_a_bad_row_like_train(write, tmp_path):
    data = rows(tmp_path / "chat.jsonl", [chat(1), {"messages": []}])
    config = write("sft.yaml", f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                               f"data: {{train: {data}}}\n")
    result = run_cli("data", str(config), cwd=tmp_path)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert f"error: {data} row 2: `messages` is an empty conversation" in result.stderr


@pytest.mark.slow
def test_data_shows_dpo_pairs_with_the_prompt_it_uses(write, tmp_path):
    prompt = "sort: b a"
    row = {"prompt": prompt, "score": 9,
           "chosen": [{"role": "user", "content": prompt}, {"role": "assistant", "content": "a b"}],
           "rejected": [{"role": "user", "content": prompt},
                        {"role": "assistant", "content": "b a"}]}
    data = rows(tmp_path / "prefs.jsonl", [row] * 3)
    config = write("dpo.yaml", f"method: dpo\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                               f"data: {{train: {data}}}\ntraining: {{max_length: 64}}\n")
    result = run_cli("data", str(config), "-n", "1", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "note: " in out and "(TRL's implicit prompt) (3 row(s))" in out
    assert "chosen: <|bos|><|user|> sort: b a<|end|><|assistant|>⟦ a b<|eos|>⟧" in out
    assert "rejected: <|bos|><|user|> sort: b a<|end|><|assistant|>⟦ b a<|eos|>⟧" in out
    assert "training.max_length 64: 0 of 3 rows longer: 0 cut, 0 dropped" in out


def _every_method_config(name: str, tmp_path) -> str:
    """A small experiment of method `name` on the quickstart data (prompts for the
    generating methods, with a reward function where they need one)."""
    from conftest import DATA
    from finetune.config.methods import method

    own = method(name)
    prompts = rows(tmp_path / "prompts.jsonl", [{"prompt": f"count to {i}"} for i in range(4)])
    data = {"score": DATA / "classify_train.jsonl" if own.labels else DATA / "pref_train.jsonl",
            "lm": DATA / "sft_train.jsonl"}[own.head]
    if own.head == "lm" and "preference" in own.formats:
        data = DATA / "pref_train.jsonl"
    if own.rewarded:
        data = prompts
    extra = {"classify": "classify: {labels: [early, middle, late]}\n",
             "distill": f"distill: {{teacher: {TINY_MODEL}}}\n",
             "gkd": f"distill: {{teacher: {TINY_MODEL}}}\n",
             "ppo": "ppo: {max_new_tokens: 8}\n"}.get(name, "")
    if own.completion_length == "training.max_completion_length":
        extra += "training: {max_completion_length: 8}\n"
    if own.rewarded:
        (tmp_path / "rewards.py").write_text(
            "def short(completions, **kw):\n    return [0.0 for _ in completions]\n")
        extra += "rewards: {functions: [rewards.py:short]}\n"
    # 64 rows: the view of a method is the same for 64 rows as for the file's thousands
    return f"method: {name}\nmodel: {{name_or_path: {TINY_MODEL}}}\n" \
           f"data: {{train: {{path: {data}, max_samples: 64}}}}\n" + extra


@pytest.mark.slow
def test_data_shows_every_method(write, tmp_path):
    """Every method record has a view (derived from the record, not a table of names): its
    rows as the method's preparation sees them, with a length summary."""
    from finetune.config.load import load_experiment
    from finetune.config.methods import METHODS
    from finetune.commands.data_view import report

    for name in METHODS:
        config = write(f"{name}.yaml", _every_method_config(name, tmp_path))
        lines = report(load_experiment(config), 1)
        assert lines[0].startswith(f"method {name}, data format "), lines[:2]
        assert any(line.startswith("data.train: ") and not line.startswith("data.train: 0 ")
                   for line in lines), (name, lines)
        assert any("token lengths: min" in line for line in lines), (name, lines)


@pytest.mark.slow
def test_data_shows_the_first_rows_of_a_stream(write, tmp_path):
    """data.streaming: the train rows are an endless stream (train reads it lazily), so
    its length is never known; the first rows it reads are shown and summarised."""
    data = rows(tmp_path / "text.jsonl", [{"text": "word " * i} for i in range(1, 6)])
    config = write("stream.yaml", f"method: sft\nmodel: {{name_or_path: {TINY_MODEL}}}\n"
                                  f"data: {{train: {data}, eval: {data}, streaming: true}}\n"
                                  "training: {max_steps: 2, packing: true, max_length: 4}\n")
    result = run_cli("data", str(config), "-n", "2", cwd=tmp_path)
    assert result.returncode == 0, result.stderr[-2000:]
    out = result.stdout
    assert "data.train: streamed, its length unknown (read as training goes, from the " \
           "start again when it ends); the first 1000 rows it reads:" in out, out
    assert out.count(f"--- {data} line ") == 2 and "data.eval: 5 rows" in out
    assert "training.max_length 4: 1000 of 1000 rows longer" in out
