"""Teachers for methods distill and gkd: a randomly initialised tiny Llama with the tiny model's
tokenizer, saved as a model directory (or with another vocabulary size, to be refused);
and a fixed measure of how far a student is from its teacher."""

from __future__ import annotations

import json
from pathlib import Path

from conftest import DATA, QUICKSTART, TINY_MODEL


def tiny_teacher(directory: Path, seed: int = 1234, vocab_size: int | None = None) -> Path:
    """A model directory (config, weights, tokenizer) of the tiny model, random weights
    from `seed`; made once per directory."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    config = AutoConfig.from_pretrained(TINY_MODEL)
    if vocab_size is not None:
        config.vocab_size = vocab_size
    torch.manual_seed(seed)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    if vocab_size is None:
        AutoTokenizer.from_pretrained(TINY_MODEL).save_pretrained(directory)
    return directory


def held_out_kl(student_dir, teacher_dir) -> float:
    """Mean per-token KL(teacher || student) over the teacher's greedy answers to the
    held-out prompts: a fixed measure, independent of what the student generates."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(teacher_dir)
    teacher = AutoModelForCausalLM.from_pretrained(teacher_dir).eval()
    student = AutoModelForCausalLM.from_pretrained(student_dir).eval()
    rows = [json.loads(line) for line in (DATA / "sft_eval.jsonl").read_text().splitlines()]
    total, count = 0.0, 0
    with torch.no_grad():
        for row in rows[:32]:
            prompt = tokenizer.apply_chat_template(row["messages"][:1], add_generation_prompt=True,
                                                   return_tensors="pt", return_dict=True)
            ids = teacher.generate(**prompt, max_new_tokens=10, do_sample=False,
                                   pad_token_id=tokenizer.pad_token_id)
            start = prompt["input_ids"].shape[1] - 1
            p = teacher(ids).logits[0, start:-1].log_softmax(-1)
            q = student(ids).logits[0, start:-1].log_softmax(-1)
            total += (p.exp() * (p - q)).sum().item()
            count += p.shape[0]
    return total / count


def tiny_vlm_teacher(directory: Path, seed: int = 1234) -> Path:
    """A model directory of the tiny vision-language model (configs/quickstart/tiny-vlm:
    config, processor), random weights from `seed`; made once per directory."""
    if (directory / "config.json").is_file():
        return directory
    import torch
    from transformers import AutoConfig, AutoModelForImageTextToText, AutoProcessor

    source = QUICKSTART / "tiny-vlm"
    torch.manual_seed(seed)
    AutoModelForImageTextToText.from_config(AutoConfig.from_pretrained(source)) \
        .save_pretrained(directory)
    AutoProcessor.from_pretrained(source).save_pretrained(directory)
    return directory
