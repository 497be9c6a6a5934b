#!/usr/bin/env python
"""Vision-language sft throughput and memory: `finetune train` on a real VLM architecture
(random weights, seeded) with pictures of the model's own size, measured from outside the
run as bench/run.py measures text runs (bench/meter.py: the window of steps after the
warm-up, from the run's metrics.jsonl; peak RSS on the CPU, nvidia-smi above idle on a GPU).

What is built offline in the work directory: the model directory (the architecture's
config.json, its image token moved to the bench tokenizer's, bench/make_tokenizer.py plus
`<image>`), its processor (CLIP's image processor at the tower's image size, LLaVA's
processor and the quickstart VLM's chat template) and rows: one picture (drawn shapes on
noise, a few distinct files) and a question, an answer of --answer-words words.

tokens/s counts every non-pad position trained on, image tokens included (TRL's
num_tokens is attention_mask.sum()); images/s is rows/s (one picture per row).

Usage:
  python bench/vlm.py                                   # the tiny LLaVA on the CPU, ~1 min
  python bench/vlm.py --preset gpu-llava0.8b --out r.json # a 0.8B LLaVA, LoRA, one GPU
  python bench/vlm.py --preset gpu-llava0.8b --full       # the same, every weight trained
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import random
import re
import shlex
import shutil
import sys
import time
from pathlib import Path

BENCH = Path(__file__).resolve().parent
QUICKSTART = BENCH.parent / "configs" / "quickstart"
sys.path.insert(0, str(BENCH))
sys.path.insert(0, str(QUICKSTART))
import make_tokenizer  # noqa: E402
import meter  # noqa: E402
from run import machine  # noqa: E402

PRESETS = {
    # The quickstart's tiny LLaVA (32x32 pictures, 16 image tokens), one thread.
    "cpu": dict(device="cpu", model=QUICKSTART / "tiny-vlm", precision="fp32", steps=12,
                warmup_steps=2, batch_size=8, answer_words=48, lora=False, threads=1),
    # A small LLaVA (LLaVA-1.5's recipe, as TinyLLaVA builds it): CLIP ViT-L/14 at 336 px
    # (576 image tokens per picture), its MLP projector, Qwen2.5-0.5B; 0.80B parameters.
    # LoRA r=16 on the language model (the tower frozen), bf16, one GPU. For LLaVA-1.5-7B
    # itself: --model models/llava-1.5-7b (random init writes a 28 GB init-model/ first).
    "gpu-llava0.8b": dict(device="cuda", model=BENCH / "models" / "llava-clip336-qwen0.5b",
                        precision="bf16", steps=30, warmup_steps=5, batch_size=8,
                        answer_words=192, lora=True, threads=None),
}
PICTURES = 16  # distinct picture files the rows share


def parse(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter,
                                epilog="\n".join(__doc__.splitlines()[2:]))
    p.add_argument("--preset", choices=sorted(PRESETS), default="cpu")
    p.add_argument("--model", type=Path, help="a LLaVA config directory (random init; "
                   "relative: to bench/)")
    p.add_argument("--steps", type=int)
    p.add_argument("--warmup-steps", type=int, help="first steps left out of the timing")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--answer-words", type=int, help="answer length in words (= tokens)")
    p.add_argument("--lora", action="store_const", const=True, help="LoRA r=16 on the "
                   "language model (the gpu preset's default)")
    p.add_argument("--full", action="store_true", help="train every weight (no LoRA)")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/finetune-bench-vlm"))
    p.add_argument("--timeout", type=int, default=1200)
    p.add_argument("--out", type=Path, help="write the result (JSON) here")
    args = p.parse_args(argv)
    for key, value in PRESETS[args.preset].items():
        if getattr(args, key, None) is None:
            setattr(args, key, value)
    if args.full:
        args.lora = False
    if not args.model.is_absolute() and not args.model.exists():
        args.model = BENCH / args.model
    return args


def build_model_dir(source: Path, out: Path) -> dict:
    """The architecture's config with the bench tokenizer's ids, and its processor."""
    import make_vlm_assets
    from transformers import AutoConfig, AutoTokenizer, LlavaProcessor
    from transformers.models.clip.image_processing_pil_clip import CLIPImageProcessorPil

    tokenizer = AutoTokenizer.from_pretrained(str(make_tokenizer.build(out / "tokenizer")))
    tokenizer.add_tokens([make_vlm_assets.IMAGE_TOKEN], special_tokens=True)
    config = AutoConfig.from_pretrained(str(source))
    if config.model_type != "llava":
        sys.exit(f"{source}: model_type {config.model_type}; this bench builds LLaVA's "
                 "processor only")
    image_token = tokenizer.convert_tokens_to_ids(make_vlm_assets.IMAGE_TOKEN)
    config.image_token_index = image_token
    config.pad_token_id = tokenizer.pad_token_id
    text = config.get_text_config()
    text.vocab_size = max(text.vocab_size, len(tokenizer))
    vision = config.vision_config
    size = vision.image_size
    image_processor = CLIPImageProcessorPil(size={"shortest_edge": size},
                                         crop_size={"height": size, "width": size})
    processor = LlavaProcessor(
        image_processor=image_processor, tokenizer=tokenizer, patch_size=vision.patch_size,
        vision_feature_select_strategy=config.vision_feature_select_strategy,
        num_additional_image_tokens=1, image_token=make_vlm_assets.IMAGE_TOKEN,
        chat_template=make_vlm_assets.CHAT_TEMPLATE)
    model_dir = out / "model"
    processor.save_pretrained(str(model_dir))
    config.save_pretrained(str(model_dir))
    return {"model": str(model_dir), "image_size": size,
            "image_tokens": (size // vision.patch_size) ** 2}


def write_rows(out: Path, image_size: int, rows: int, answer_words: int, seed: int) -> str:
    """Rows in TRL's vision format, pictures next to the data file."""
    from PIL import Image, ImageDraw

    rng = random.Random(seed)
    words = make_tokenizer.words()
    folder = out / "pictures"
    folder.mkdir(parents=True, exist_ok=True)
    for i in range(PICTURES):
        picture = Image.effect_noise((image_size, image_size), 40).convert("RGB")
        pen = ImageDraw.Draw(picture)
        for _ in range(6):
            x, y = rng.randrange(image_size), rng.randrange(image_size)
            r = rng.randrange(image_size // 16, image_size // 4)
            pen.ellipse((x - r, y - r, x + r, y + r),
                        fill=tuple(rng.randrange(256) for _ in range(3)))
        picture.save(folder / f"{i:02d}.png")
    path = out / "rows.jsonl"
    with path.open("w") as f:
        for i in range(rows):
            question = " ".join(rng.choice(words) for _ in range(8))
            answer = " ".join(rng.choice(words) for _ in range(answer_words))
            f.write(json.dumps({
                "messages": [{"role": "user", "content": [{"type": "image"},
                                                          {"type": "text", "text": question}]},
                             {"role": "assistant", "content": [{"type": "text",
                                                                "text": answer}]}],
                "images": [f"pictures/{i % PICTURES:02d}.png"]}) + "\n")
    return str(path)


def experiment(args, files: dict, run_dir: Path) -> Path:
    lines = [
        "name: bench-vlm", "method: sft",
        f"model: {{name_or_path: {json.dumps(files['model'])}, init: random}}",
        f"data: {{train: {json.dumps(files['data'])}}}",
        f"precision: {args.precision}", f"distributed: {{device: {args.device}}}",
        "evaluation: {before_training: false}",
        f"output: {{dir: {json.dumps(str(run_dir))}, save_final: false, plot: false}}",
        "resume: never",
        f"training: {{max_steps: {args.steps}, per_device_train_batch_size: "
        f"{args.batch_size}, learning_rate: 1e-4, max_length: "
        f"{files['image_tokens'] + args.answer_words + 64}, seed: 0, logging_steps: 1, "
        "save_strategy: 'no', include_num_input_tokens_seen: all}",
    ]
    if args.lora:
        lines.append("peft: {type: lora, r: 16, alpha: 32}")
    path = args.workdir / "experiment.yaml"
    path.write_text("\n".join(lines) + "\n")
    return path


def main(argv=None) -> None:
    args = parse(argv)
    args.workdir.mkdir(parents=True, exist_ok=True)
    files = build_model_dir(args.model, args.workdir)
    files["data"] = write_rows(args.workdir, files["image_size"],
                               args.steps * args.batch_size, args.answer_words, 0)
    run_dir = args.workdir / "run"
    shutil.rmtree(run_dir, ignore_errors=True)  # the previous invocation's
    config = experiment(args, files, run_dir)
    script = Path(sys.executable).parent / "finetune"
    command = [str(script)] if script.exists() else [sys.executable, "-m", "finetune"]
    cmd = [*command, "train", str(config)]
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "HF_DATASETS_OFFLINE": "1",
           "TOKENIZERS_PARALLELISM": "false"}
    if args.threads:
        env["OMP_NUM_THREADS"] = env["MKL_NUM_THREADS"] = str(args.threads)
    idle = meter.gpu_used_mib() if args.device == "cuda" else None
    log = args.workdir / "train.log"
    log.write_text(shlex.join(cmd) + "\n")
    started = time.time()
    code, memory = meter.run_measured(cmd, log, env, BENCH.parent, args.timeout,
                                      gpu_idle_mib=idle)
    if code != 0:
        sys.exit(f"finetune train exited {code}; {log}:\n" +
                 "\n".join(log.read_text().splitlines()[-20:]))
    result = meter.window(run_dir / "metrics.jsonl", args.warmup_steps)
    result.update(memory, images_per_s=round(result["steps"] * args.batch_size /
                                             result["seconds"], 2),
                  wall_s=round(time.time() - started, 1))
    said = re.search(r"parameters (\S+) trainable of (\S+)", log.read_text())
    trainable = {"trainable": said[1], "total": said[2]} if said else {}
    out = {"date": datetime.date.today().isoformat(), "command": shlex.join(sys.argv),
           "machine": machine(args.device), "experiment": config.read_text(),
           "image_tokens": files["image_tokens"], "parameters": trainable,
           "result": {k: v for k, v in result.items() if k != "tokens_by_step"}}
    if args.out:
        args.out.write_text(json.dumps(out, indent=1, default=str) + "\n")
    peak = result.get("peak_mem_bytes")
    memory_said = f"peak {peak / 2**30:.2f} GiB ({result['peak_mem_kind']})" if peak else \
        f"peak n/a ({result.get('peak_mem_note')})"
    print(f"{args.preset}: {result['tokens_per_s']:,.0f} tokens/s, "
          f"{result['images_per_s']:.2f} images/s, {result['s_per_step']:.3f} s/step, "
          + memory_said)

if __name__ == "__main__":
    main()
