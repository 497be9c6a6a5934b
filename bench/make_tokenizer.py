#!/usr/bin/env python
"""Write the benchmark's tokenizer: word-level, one token per word, built offline.

Why a tokenizer of our own: nothing can be downloaded, and a word-level vocabulary makes
token counts exact (a row of N words is N tokens plus the chat template's 5), so the data
generator controls sequence lengths precisely. Its ids (0..VOCAB_SIZE-1) are a prefix of
every model's vocabulary: the GPU presets keep the real vocab_size of the model they
imitate (151936 for Qwen2.5, 128256 for Llama 3), so the embedding and the LM head (a
large share of the FLOPs of a small model) have realistic shapes; only ids < 1024 occur.

Usage: python bench/make_tokenizer.py --out DIR
"""

from __future__ import annotations

import argparse
import itertools
import os
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

VOCAB_SIZE = 1024
PAD, BOS, EOS, UNK = "<|pad|>", "<|bos|>", "<|eos|>", "<|unk|>"
USER, ASSISTANT, SYSTEM, END = "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"
SPECIAL = [PAD, BOS, EOS, UNK, USER, ASSISTANT, SYSTEM, END]

# The quickstart's template (configs/quickstart/tiny-llama): the assistant turn sits in
# {% generation %} markers, so assistant_only_loss works if a benchmark turns it on.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)
TEMPLATE_TOKENS = 5  # bos, <|user|>, <|end|>, <|assistant|>, eos around one exchange


def words() -> list[str]:
    """VOCAB_SIZE - len(SPECIAL) pronounceable pseudo-words, deterministic (no RNG)."""
    syllables = [c + v for c in "bdfgklmnprstvz" for v in "aeiou"]  # 70
    pairs = (a + b for a, b in itertools.product(syllables, repeat=2))
    return list(itertools.islice(pairs, VOCAB_SIZE - len(SPECIAL)))


def build(out: Path) -> Path:
    from tokenizers import Tokenizer, pre_tokenizers
    from tokenizers.models import WordLevel
    from transformers import PreTrainedTokenizerFast

    vocab = {token: i for i, token in enumerate(SPECIAL + words())}
    core = Tokenizer(WordLevel(vocab, unk_token=UNK))
    core.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    core.add_special_tokens(SPECIAL)  # split out of "<|user|>word word<|end|>"
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=core, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM, END], padding_side="right",
        model_max_length=1 << 20)
    tokenizer.chat_template = CHAT_TEMPLATE
    out.mkdir(parents=True, exist_ok=True)
    tokenizer.save_pretrained(str(out))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    out = build(parser.parse_args().out)
    print(f"tokenizer ({VOCAB_SIZE} tokens) written to {out}")


if __name__ == "__main__":
    main()
