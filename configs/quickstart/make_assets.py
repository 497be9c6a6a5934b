#!/usr/bin/env python
"""Write the bundled quickstart assets: a tiny Llama config, a locally trained
tokenizer and small synthetic SFT / preference datasets.

Task: "sort: <3-5 distinct words>" -> the same words in alphabetical order.
The word list has 24 words with distinct initials, so the order is obvious to a
human reader.  Held-out rows use word *sets* that never appear (in any order,
in any train file), so a held-out success needs generalisation, not memory.

Preference rows (shared by reward modelling and DPO) use the same prompts; the
rejected answer is a wrong answer to the same prompt: the words left in the
input order, the sorted list with two neighbours swapped, or the sorted list
with the first and last words swapped.  Rejected answers are always a
permutation of the right words, so a model has to check the order.

Everything is deterministic (fixed seeds, no network): running the script twice
writes byte-identical files.

Usage:  python configs/quickstart/make_assets.py [--out DIR]   (default: next to this file)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent

# 24 words, distinct initials (alphabetical order == order of initials).
WORDS = [
    "apple", "bread", "cat", "dog", "egg", "fish", "goat", "hat",
    "ice", "jam", "kite", "lamp", "moon", "nut", "owl", "pen",
    "queen", "rose", "sun", "tree", "van", "wolf", "yak", "zebra",
]
MIN_LEN, MAX_LEN = 3, 5
INSTRUCTION = "sort:"

N_SFT_TRAIN, N_SFT_EVAL = 4000, 200
N_PREF_TRAIN, N_PREF_EVAL = 3000, 200
SEED = 1234

BOS, EOS, PAD = "<|bos|>", "<|eos|>", "<|pad|>"
USER, ASSISTANT, SYSTEM, END = "<|user|>", "<|assistant|>", "<|system|>", "<|end|>"
SPECIAL_TOKENS = [PAD, BOS, EOS, USER, ASSISTANT, SYSTEM, END]

# The assistant turn (content + EOS) is wrapped in {% generation %} markers so
# that TRL's assistant_only_loss can mask everything else.  The prompt rendered
# with add_generation_prompt=True is a token prefix of the full conversation
# (no whitespace between turns; special tokens split the text).
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['role'] == 'system' %}"
    "{{ '<|system|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'user' %}"
    "{{ '<|user|>' + message['content'] + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}"
    "{{ '<|assistant|>' }}"
    "{% generation %}{{ message['content'] + eos_token }}{% endgeneration %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

MODEL_CONFIG = dict(
    hidden_size=128,
    intermediate_size=512,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=4,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_theta=10000.0,
    tie_word_embeddings=True,
    initializer_range=0.02,
    hidden_act="silu",
    attention_dropout=0.0,
)


def sort_words(words):
    return sorted(words)


def make_prompt(words):
    return f"{INSTRUCTION} {' '.join(words)}"


def make_answer(words):
    return " ".join(sort_words(words))


def wrong_answer(words, rng):
    """A permutation of `words` that is not sorted."""
    target = sort_words(words)
    kinds = ["swap_adjacent", "swap_ends"]
    if list(words) != target:
        kinds.append("unchanged")
    kind = rng.choice(kinds)
    if kind == "unchanged":
        out = list(words)
    elif kind == "swap_ends":
        out = list(target)
        out[0], out[-1] = out[-1], out[0]
    else:
        out = list(target)
        i = rng.randrange(len(out) - 1)
        out[i], out[i + 1] = out[i + 1], out[i]
    assert out != target
    return " ".join(out)


def sample_words(rng):
    n = rng.randint(MIN_LEN, MAX_LEN)
    return rng.sample(WORDS, n)


def build_splits(rng):
    """Reserve held-out word sets first, then sample train rows outside them."""
    heldout_sets: list[frozenset] = []
    heldout_lookup: set[frozenset] = set()
    n_heldout = N_SFT_EVAL + N_PREF_EVAL
    while len(heldout_sets) < n_heldout:
        key = frozenset(sample_words(rng))
        if key not in heldout_lookup:
            heldout_lookup.add(key)
            heldout_sets.append(key)

    def eval_rows(sets):
        rows = []
        for key in sets:
            words = sorted(key)
            rng.shuffle(words)
            rows.append(words)
        return rows

    sft_eval = eval_rows(heldout_sets[:N_SFT_EVAL])
    pref_eval = eval_rows(heldout_sets[N_SFT_EVAL:])

    def train_rows(n):
        rows = []
        while len(rows) < n:
            words = sample_words(rng)
            if frozenset(words) in heldout_lookup:
                continue
            rows.append(words)
        return rows

    sft_train = train_rows(N_SFT_TRAIN)
    pref_train = train_rows(N_PREF_TRAIN)
    return sft_train, sft_eval, pref_train, pref_eval


def sft_row(words):
    return {
        "messages": [
            {"role": "user", "content": make_prompt(words)},
            {"role": "assistant", "content": make_answer(words)},
        ]
    }


def pref_row(words, rng):
    # Conversational preference rows: TRL renders them with the chat template
    # (prompt with add_generation_prompt=True, completions end with EOS).
    return {
        "prompt": [{"role": "user", "content": make_prompt(words)}],
        "chosen": [{"role": "assistant", "content": make_answer(words)}],
        "rejected": [{"role": "assistant", "content": wrong_answer(words, rng)}],
    }


# Classification: where in the alphabet a list's first word falls (a-h, i-p, q-z).
# Deliberately imbalanced (70/20/10 %), the case class weights are for; the eval split
# is balanced, so per-class recall shows what the weights change.
CLASSES = {"early": WORDS[:8], "middle": WORDS[8:16], "late": WORDS[16:]}
CLASS_SHARES = [0.7, 0.2, 0.1]
N_CLASSIFY_TRAIN, N_CLASSIFY_EVAL = 1200, 150


def classify_rows(rng, n, balanced):
    names = list(CLASSES) * (n // len(CLASSES)) if balanced else rng.choices(
        list(CLASSES), weights=CLASS_SHARES, k=n)
    rows = []
    for name in names:
        first = rng.choice(CLASSES[name])
        rest = rng.sample([w for w in WORDS if w != first], rng.randint(MIN_LEN, MAX_LEN) - 1)
        rows.append({"text": " ".join([first, *rest]), "label": name})
    return rows


def write_jsonl(path: Path, rows):
    path.parent.mkdir(parents=True, exist_ok=True)
    with open(path, "w", encoding="utf-8", newline="\n") as f:
        for row in rows:
            f.write(json.dumps(row, ensure_ascii=False, sort_keys=False) + "\n")


def build_tokenizer():
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers
    from transformers import PreTrainedTokenizerFast

    tok = Tokenizer(models.BPE())
    # add_prefix_space=True: every segment between special tokens starts with a
    # space, so each task word is always the same single token ("Ġapple").
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=True)
    tok.decoder = decoders.ByteLevel()
    tok.post_processor = processors.ByteLevel(trim_offsets=False)
    trainer = trainers.BpeTrainer(
        vocab_size=512,
        min_frequency=1,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    # Corpus: every task word many times plus the instruction, in a fixed order.
    corpus = [f"{INSTRUCTION} " + " ".join(WORDS)] * 50 + [w for w in WORDS for _ in range(10)]
    tok.train_from_iterator(corpus, trainer=trainer)

    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        bos_token=BOS,
        eos_token=EOS,
        pad_token=PAD,
        additional_special_tokens=[USER, ASSISTANT, SYSTEM, END],
        padding_side="right",
        model_max_length=MODEL_CONFIG["max_position_embeddings"],
        clean_up_tokenization_spaces=False,
    )
    fast.chat_template = CHAT_TEMPLATE
    # Every task word (with its leading space) must be a single token.
    for w in WORDS + [INSTRUCTION]:
        ids = fast(" " + w, add_special_tokens=False)["input_ids"]
        assert len(ids) == 1 or (w == INSTRUCTION and len(ids) <= 2), (w, ids)
    return fast


def build_model_config(tokenizer):
    from transformers import LlamaConfig

    return LlamaConfig(
        # With `architectures` set, TRL trainers that rebuild a reference model from
        # model.config._name_or_path fail with a clear "no model.safetensors" OSError
        # instead of "TypeError: 'NoneType' object is not subscriptable".
        architectures=["LlamaForCausalLM"],
        vocab_size=len(tokenizer),
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        **MODEL_CONFIG,
    )


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE))
    args = ap.parse_args()
    out = Path(args.out)
    model_dir, data_dir = out / "tiny-llama", out / "data"
    model_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    written = []
    # Save through a temp dir and copy only the files we ship, so that stale or
    # extra files (e.g. chat_template.jinja) never end up in the assets.
    with tempfile.TemporaryDirectory() as tmp:
        tokenizer.save_pretrained(tmp, save_jinja_files=False)
        for name in ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"):
            src = Path(tmp) / name
            if src.exists():
                (model_dir / name).write_bytes(src.read_bytes())
                written.append(model_dir / name)
    build_model_config(tokenizer).to_json_file(model_dir / "config.json")
    written.append(model_dir / "config.json")

    rng = random.Random(SEED)
    sft_train, sft_eval, pref_train, pref_eval = build_splits(rng)
    outputs = {
        "sft_train": [sft_row(w) for w in sft_train],
        "sft_eval": [sft_row(w) for w in sft_eval],
        "pref_train": [pref_row(w, rng) for w in pref_train],
        "pref_eval": [pref_row(w, rng) for w in pref_eval],
    }
    classify_rng = random.Random(SEED + 1)  # its own stream: the files above stay as they were
    outputs["classify_train"] = classify_rows(classify_rng, N_CLASSIFY_TRAIN, balanced=False)
    outputs["classify_eval"] = classify_rows(classify_rng, N_CLASSIFY_EVAL, balanced=True)
    for name, rows in outputs.items():
        write_jsonl(data_dir / f"{name}.jsonl", rows)
        written.append(data_dir / f"{name}.jsonl")

    for p in written:
        print(f"{p.stat().st_size:>9}  {p.relative_to(out)}")

if __name__ == "__main__":
    main()
