"""Teachers for method distill: a randomly initialised tiny Llama with the tiny model's
tokenizer, saved as a model directory (or with another vocabulary size, to be refused)."""

from __future__ import annotations

from pathlib import Path

from conftest import TINY_MODEL


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
