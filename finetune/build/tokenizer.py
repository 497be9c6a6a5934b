"""The tokenizer, its chat template and its padding token."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from finetune.config.schema import Experiment
from finetune.errors import RunError


def load_tokenizer(experiment: Experiment) -> PreTrainedTokenizerBase:
    source = experiment.tokenizer.name_or_path or experiment.model.name_or_path
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source,
            revision=experiment.model.revision if experiment.tokenizer.name_or_path is None else None,
            trust_remote_code=experiment.model.trust_remote_code,
        )
    except OSError as exc:  # missing files, no network, unknown hub id
        raise RunError(f"cannot load the tokenizer from {source!r}: {exc}") from None
    template = experiment.tokenizer.chat_template
    if template:
        is_inline = "{{" in template or "{%" in template
        tokenizer.chat_template = template if is_inline else Path(template).read_text()
    if experiment.tokenizer.pad_token:
        tokenizer.pad_token = experiment.tokenizer.pad_token
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer
