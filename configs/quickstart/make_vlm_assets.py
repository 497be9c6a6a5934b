#!/usr/bin/env python
"""Write the bundled vision-language quickstart assets: a tiny LLaVA-style model (a tiny
CLIP vision tower, a projector and the quickstart's tiny Llama), its processor (image
processor, tokenizer with an <image> token, chat template), and a synthetic image task.

Task: a 32x32 picture of one coloured shape (ring, square or triangle; red, green,
blue or yellow; anywhere, of any size from 18 to 28 px) and one of two questions, "What
color is the shape?" or "What shape is it?"; the answer is one word. Every picture is
a fresh draw: held-out pictures are other pictures than the training ones.

Rows are in TRL's vision format: `messages` whose content is a list of parts
({"type": "image"} and {"type": "text", "text": ...}) and `images`, the image files'
paths relative to the data file. The preference rows (vlm_pref_*.jsonl, for dpo) ask the
same questions about the same pictures: `prompt` (the question with its image part),
`chosen` the right answer, `rejected` a wrong one of the same kind, and `images`.

Everything is deterministic (fixed seeds, no network): running the script twice writes
byte-identical files (PNG written by Pillow without metadata).

Usage:  python configs/quickstart/make_vlm_assets.py [--out DIR]   (default: next to this file)
"""

from __future__ import annotations

import argparse
import json
import os
import random
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

HERE = Path(__file__).resolve().parent
sys.dont_write_bytecode = True  # no __pycache__ beside the assets
sys.path.insert(0, str(HERE))
import make_assets  # noqa: E402  the tiny Llama's tokenizer and text model

IMAGE_TOKEN = "<image>"
IMAGE_SIZE, PATCH_SIZE = 32, 8  # 4 x 4 patches: 16 image tokens per picture
COLORS = {"red": (220, 30, 30), "green": (30, 170, 40), "blue": (30, 60, 220),
          "yellow": (235, 200, 20)}
SHAPES = ("ring", "square", "triangle")
QUESTIONS = {"color": "What color is the shape?", "shape": "What shape is it?"}
N_TRAIN, N_EVAL = 2000, 200
SEED = 4321
PREF_SEED = 8765  # the rejected answers' draws, apart: the pictures stay as they were

# Content is a string or a list of parts; an image part becomes the image token, which the
# processor expands to one token per patch. The assistant turn (text + EOS) is wrapped in
# {% generation %} markers, so TRL's assistant_only_loss masks everything else: the
# prompt, and with it every image token.
CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{% if message['content'] is string %}"
    "{% set parts = [{'type': 'text', 'text': message['content']}] %}"
    "{% else %}{% set parts = message['content'] %}{% endif %}"
    "{% set ns = namespace(text='') %}"
    "{% for part in parts %}"
    "{% if part['type'] == 'image' %}{% set ns.text = ns.text + '" + IMAGE_TOKEN + "' %}"
    "{% elif part['type'] == 'text' %}{% set ns.text = ns.text + part['text'] %}{% endif %}"
    "{% endfor %}"
    "{% if message['role'] == 'system' %}{{ '<|system|>' + ns.text + '<|end|>' }}"
    "{% elif message['role'] == 'user' %}{{ '<|user|>' + ns.text + '<|end|>' }}"
    "{% elif message['role'] == 'assistant' %}{{ '<|assistant|>' }}"
    "{% generation %}{{ ns.text + eos_token }}{% endgeneration %}"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|assistant|>' }}{% endif %}"
)

VISION_CONFIG = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    image_size=IMAGE_SIZE,
    patch_size=PATCH_SIZE,
    num_channels=3,
    projection_dim=64,
)


def build_tokenizer():
    """The tiny Llama's tokenizer with the image token added (a special token, so it is
    never split) and this task's chat template."""
    tokenizer = make_assets.build_tokenizer()
    tokenizer.add_tokens([IMAGE_TOKEN], special_tokens=True)
    tokenizer.chat_template = CHAT_TEMPLATE
    return tokenizer


def build_processor(tokenizer):
    from transformers import LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    # Pictures are drawn at the model's size: resizing and cropping change nothing.
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": IMAGE_SIZE},
                                            crop_size={"height": IMAGE_SIZE, "width": IMAGE_SIZE})
    # CLIP adds a CLS token (num_additional_image_tokens 1), which the "default" feature
    # selection drops again: (32 / 8)^2 = 16 image tokens.
    return LlavaProcessor(image_processor=image_processor, tokenizer=tokenizer,
                          patch_size=PATCH_SIZE, vision_feature_select_strategy="default",
                          num_additional_image_tokens=1, image_token=IMAGE_TOKEN,
                          chat_template=CHAT_TEMPLATE)


def build_model_config(tokenizer):
    from transformers import CLIPVisionConfig, LlavaConfig

    text = make_assets.build_model_config(tokenizer).to_dict()
    text.pop("architectures", None)
    return LlavaConfig(
        architectures=["LlavaForConditionalGeneration"],
        vision_config=CLIPVisionConfig(**VISION_CONFIG).to_dict(),
        text_config=text,
        image_token_index=tokenizer.convert_tokens_to_ids(IMAGE_TOKEN),
        image_seq_length=(IMAGE_SIZE // PATCH_SIZE) ** 2,
        vision_feature_select_strategy="default",
        vision_feature_layer=-1,
        tie_word_embeddings=True,
        pad_token_id=tokenizer.pad_token_id,
    )


def draw(color: str, shape: str, rng: random.Random):
    from PIL import Image, ImageDraw

    image = Image.new("RGB", (IMAGE_SIZE, IMAGE_SIZE), (255, 255, 255))
    size = rng.randint(18, 28)
    x, y = rng.randint(0, IMAGE_SIZE - size), rng.randint(0, IMAGE_SIZE - size)
    box = (x, y, x + size - 1, y + size - 1)
    pen = ImageDraw.Draw(image)
    fill = COLORS[color]
    if shape == "ring":  # hollow: a filled disc is too like a square at 8-px patches
        pen.ellipse(box, outline=fill, width=max(3, size // 5))
    elif shape == "square":
        pen.rectangle(box, fill=fill)
    else:
        pen.polygon([(x + size // 2, y), (x, y + size - 1), (x + size - 1, y + size - 1)],
                    fill=fill)
    return image


def rows(split: str, n: int, rng: random.Random, data_dir: Path) -> list[dict]:
    out = []
    folder = data_dir / f"vlm_{split}"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        color, shape = rng.choice(sorted(COLORS)), rng.choice(SHAPES)
        kind = rng.choice(sorted(QUESTIONS))
        name = f"{i:04d}.png"
        draw(color, shape, rng).save(folder / name, format="PNG", optimize=True)
        out.append({
            "messages": [
                {"role": "user", "content": [{"type": "image"},
                                             {"type": "text", "text": QUESTIONS[kind]}]},
                {"role": "assistant", "content": [{"type": "text",
                                                   "text": color if kind == "color" else shape}]},
            ],
            "images": [f"vlm_{split}/{name}"],
        })
    return out


def preference_rows(sft_rows: list[dict], rng: random.Random) -> list[dict]:
    """Preference pairs about the same pictures: the question as the prompt, the right
    answer chosen, a wrong one of the same kind (another color, another shape) rejected."""
    out = []
    for row in sft_rows:
        question, answer = row["messages"]
        right = answer["content"][0]["text"]
        choices = sorted(COLORS) if right in COLORS else list(SHAPES)
        wrong = rng.choice([c for c in choices if c != right])
        say = lambda text: [{"role": "assistant", "content": [{"type": "text", "text": text}]}]
        out.append({"prompt": [question], "chosen": say(right), "rejected": say(wrong),
                    "images": row["images"]})
    return out


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=str(HERE))
    args = ap.parse_args()
    out = Path(args.out)
    model_dir, data_dir = out / "tiny-vlm", out / "data"
    model_dir.mkdir(parents=True, exist_ok=True)

    tokenizer = build_tokenizer()
    processor = build_processor(tokenizer)
    written = []
    # Save through a temp dir and copy only the files we ship (see make_assets.py).
    shipped = ("tokenizer.json", "tokenizer_config.json", "processor_config.json",
               "chat_template.jinja")
    with tempfile.TemporaryDirectory() as tmp:
        processor.save_pretrained(tmp)
        for name in shipped:
            src = Path(tmp) / name
            if src.exists():
                (model_dir / name).write_bytes(src.read_bytes())
                written.append(model_dir / name)
    build_model_config(tokenizer).to_json_file(model_dir / "config.json")
    written.append(model_dir / "config.json")

    rng, pref_rng = random.Random(SEED), random.Random(PREF_SEED)
    for split, n in (("train", N_TRAIN), ("eval", N_EVAL)):
        path = data_dir / f"vlm_{split}.jsonl"
        split_rows = rows(split, n, rng, data_dir)
        make_assets.write_jsonl(path, split_rows)
        pref_path = data_dir / f"vlm_pref_{split}.jsonl"
        make_assets.write_jsonl(pref_path, preference_rows(split_rows, pref_rng))
        written += [path, pref_path]

    for p in written:
        print(f"{p.stat().st_size:>9}  {p.relative_to(out)}")
    images = sorted((data_dir).glob("vlm_*/*.png"))
    print(f"{sum(p.stat().st_size for p in images):>9}  {len(images)} PNG files in data/vlm_*/")


if __name__ == "__main__":
    main()
