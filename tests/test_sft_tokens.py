"""finetune's sft tokenization gives TRL's settings their meaning: which tokens are trained
(assistant_only_loss, completion_only_loss), how rows are cut (max_length,
truncation_mode), and rows left with nothing to train are dropped."""

from __future__ import annotations

import pytest
from datasets import Dataset
from transformers import AutoTokenizer

from conftest import TINY_MODEL
from finetune.data.sft_tokens import IGNORE, Masking, tokenize
from finetune.errors import DataError

CHAT = [{"role": "user", "content": "sort cat apple"},
        {"role": "assistant", "content": "apple cat"},
        {"role": "user", "content": "again"},
        {"role": "assistant", "content": "apple cat"}]


@pytest.fixture(scope="module")
def tokenizer():
    return AutoTokenizer.from_pretrained(TINY_MODEL)


def _one(tokenizer, rows, fmt, **masking):
    return tokenize(Dataset.from_list(rows), tokenizer, fmt, Masking(**masking), "train")


def test_messages_train_everything_or_only_the_assistant_turns(tokenizer):
    ids = tokenizer.apply_chat_template(CHAT, tokenize=True, return_dict=True)["input_ids"]
    everything = _one(tokenizer, [{"messages": CHAT}], "messages")[0]
    assert everything["input_ids"] == list(ids) and everything["labels"] == list(ids)

    assistant = _one(tokenizer, [{"messages": CHAT}], "messages", assistant_only=True)[0]
    trained = [t for t in assistant["labels"] if t != IGNORE]
    # Both answers, each with the template's end-of-turn token, and nothing else.
    answer = tokenizer.apply_chat_template(CHAT[:2], tokenize=True, return_dict=True)["input_ids"]
    prompt = tokenizer.apply_chat_template(CHAT[:1], tokenize=True, return_dict=True,
                                           add_generation_prompt=True)["input_ids"]
    turn = list(answer[len(prompt):])
    assert trained == turn + turn
    assert tokenizer.decode(turn).strip().startswith("apple cat")


def test_prompt_completion_trains_the_completion_unless_told_otherwise(tokenizer):
    rows = [{"prompt": "sort cat apple:", "completion": " apple cat"}]
    head = tokenizer("sort cat apple:")["input_ids"]
    row = _one(tokenizer, rows, "prompt_completion")[0]
    assert row["labels"][:len(head)] == [IGNORE] * len(head)
    assert row["labels"][len(head):] == row["input_ids"][len(head):]
    assert row["input_ids"][-1] == tokenizer.eos_token_id
    whole = _one(tokenizer, rows, "prompt_completion", completion_only=False)[0]
    assert whole["labels"] == whole["input_ids"]


def test_truncation_keeps_the_start_or_the_end_and_drops_untrained_rows(tokenizer):
    rows = [{"prompt": "a b c d e f g h", "completion": " x y"},
            {"prompt": "a", "completion": " b"}]
    full = _one(tokenizer, rows, "prompt_completion")
    start = _one(tokenizer, rows, "prompt_completion", max_length=4)
    # Row 1's completion lies beyond 4 tokens: nothing left to train, so it is dropped.
    assert len(start) == 1 and start[0]["input_ids"] == full[1]["input_ids"][:4]
    end = _one(tokenizer, rows, "prompt_completion", max_length=4, keep_end=True)
    assert len(end) == 2 and end[0]["input_ids"] == full[0]["input_ids"][-4:]
    with pytest.raises(DataError, match="no row has a trained token left"):
        _one(tokenizer, rows[:1], "prompt_completion", max_length=3)


def test_weights_follow_the_trained_tokens(tokenizer):
    chat = [dict(m) for m in CHAT]
    chat[1]["weight"] = 0.5
    row = _one(tokenizer, [{"messages": chat, "weight": 2.0}], "messages",
               assistant_only=True, weighted=True)[0]
    weights = [w for w, t in zip(row["token_weights"], row["labels"]) if t != IGNORE]
    half = len(weights) // 2
    assert weights == [1.0] * half + [2.0] * half
    assert all(w == 0.0 for w, t in zip(row["token_weights"], row["labels"]) if t == IGNORE)


def test_a_conversation_the_template_cannot_split_renders_through_trls_training_version(
        tokenizer):
    """Qwen3's template drops the think block of an assistant turn before the last user
    turn, so "the conversation through turn 1" is no prefix of the whole: such a
    conversation renders through TRL's training version of the template (every turn's
    think block kept); a one-turn conversation still renders as the template has it; a
    template TRL has no version of is refused naming the row."""
    from pathlib import Path

    import trl

    templates = Path(trl.__file__).parent / "chat_templates"
    qwen3 = tokenizer.__class__.from_pretrained(TINY_MODEL)
    qwen3.chat_template = (templates / "qwen3.jinja").read_text()
    training = (templates / "qwen3_training.jinja").read_text()

    def rendered(messages, template=None):
        return list(qwen3.apply_chat_template(messages, tokenize=True, return_dict=True,
                                              chat_template=template)["input_ids"])

    rows = _one(qwen3, [{"messages": CHAT}, {"messages": CHAT[:2]}], "messages",
                assistant_only=True)
    assert rendered(CHAT) != rendered(CHAT, training)
    assert rows[0]["input_ids"] == rendered(CHAT, training)
    assert rows[1]["input_ids"] == rendered(CHAT[:2]) == rendered(CHAT[:2], training)
    trained = qwen3.decode([t for t in rows[0]["labels"] if t != IGNORE])
    assert trained == 2 * "<think>\n\n</think>\n\napple cat<|im_end|>\n"

    qwen3.chat_template = qwen3.chat_template.replace("<|im_start|>", "<|im_start|> ")
    with pytest.raises(DataError, match="data.train row 1: the chat template does not "
                                        "render this conversation turn by turn"):
        _one(qwen3, [{"messages": CHAT}], "messages", assistant_only=True)
