"""The tokenizer, its chat template and its padding token; a vision-language model's
processor (which holds the tokenizer)."""

from __future__ import annotations

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from finetune.model import chat_template
from finetune.model.load import refuse_remote_code, remote_code_error
from finetune.model.vision import is_processor
from finetune.config.schema import Experiment
from finetune.errors import ConfigError, RunError, first_line


def load_tokenizer(experiment: Experiment) -> PreTrainedTokenizerBase:
    source, key = _source(experiment)
    refuse_remote_code(experiment, source, key)
    try:
        tokenizer = AutoTokenizer.from_pretrained(
            source,
            revision=experiment.model.revision if experiment.tokenizer.name_or_path is None else None,
            trust_remote_code=experiment.model.trust_remote_code,
        )
    except OSError as exc:  # missing files, no network, unknown hub id
        raise RunError(f"{key}: cannot load the tokenizer from {source!r}: "
                       f"{first_line(exc)}") from None
    except ValueError as exc:
        raise remote_code_error(exc, source, key) from None
    return _with_settings(tokenizer, experiment)


def load_processor(experiment: Experiment):
    """A vision-language model's processor (model/vision.py), with the tokenizer section
    applied as to a text model's tokenizer."""
    source, key = _source(experiment)
    refuse_remote_code(experiment, source, key)
    spec = experiment.model
    try:
        processor = processor_from(
            source, spec.revision if experiment.tokenizer.name_or_path is None else None,
            spec.trust_remote_code, key)
    except OSError as exc:
        raise RunError(f"{key}: cannot load the processor of a vision-language model from "
                       f"{source!r}: {first_line(exc)}") from None
    except ValueError as exc:
        raise remote_code_error(exc, source, key) from None
    if not is_processor(processor):
        raise RunError(f"{key}: {source!r} is a vision-language model without a processor "
                       f"(AutoProcessor gave a {type(processor).__name__}): it needs "
                       "processor_config.json or preprocessor_config.json")
    return _with_settings(processor, experiment)


def processor_from(source: str, revision: str | None, trusted: bool, key: str):
    """AutoProcessor's processor of `source`. A library it needs that is not installed is
    one line naming `key`: transformers 5.23 builds a processor that takes videos
    (Qwen2-VL's, Qwen2.5-VL's, SmolVLM's, ...) only with its video processor, which needs
    torchvision, even for rows with images only."""
    from transformers import AutoProcessor

    try:
        return AutoProcessor.from_pretrained(source, trust_remote_code=trusted,
                                             revision=revision)
    except ImportError as exc:
        if "torchvision" in str(exc).lower():
            import torch

            raise ConfigError([f"{key}: the processor of {source!r} needs torchvision, which "
                               "is not installed: pip install torchvision (the build made "
                               f"for the installed torch {torch.__version__}, from where it "
                               "came; bash setup.sh --cuda or --torch-index URL installs "
                               "the pair: docs/install.md)"]) from None
        raise RunError(f"{key}: cannot load the processor of {source!r}: "
                       f"{first_line(exc)}") from None


def _source(experiment: Experiment) -> tuple[str, str]:
    if experiment.tokenizer.name_or_path:
        return experiment.tokenizer.name_or_path, "tokenizer.name_or_path"
    return experiment.model.name_or_path, "model.name_or_path"


def _with_settings(processing_class, experiment: Experiment):
    """tokenizer.chat_template (on the processor of a VLM: its template renders the
    images) and the padding token (on the tokenizer)."""
    template = chat_template.setting(experiment)
    if template:
        processing_class.chat_template = template
    tokenizer = getattr(processing_class, "tokenizer", processing_class)
    if experiment.tokenizer.pad_token:
        tokenizer.pad_token = experiment.tokenizer.pad_token
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return processing_class


def end_marker(tokenizer: PreTrainedTokenizerBase) -> str:
    """What ends a plain text scored by a sequence-classification head. A decoder's head
    reads the last token, so TRL appends the EOS: every score then comes from one token
    that has seen the whole text. An encoder's tokenizer frames each text itself
    ([CLS] ... [SEP]) and its head reads [CLS]: nothing is appended (an EOS there would
    double the [SEP], or fail: BERT has none). "" when nothing is appended."""
    probe = tokenizer("a")["input_ids"]
    if probe and probe[-1] in tokenizer.all_special_ids:
        return ""  # the tokenizer ends every text with its own special token
    return tokenizer.eos_token or ""


def render_chat(tokenizer: PreTrainedTokenizerBase, messages: list[dict], where: str,
                generation_prompt: bool = False, tools: list[dict] | None = None,
                template: str | None = None) -> list[int]:
    """The token ids of a conversation through the chat template. A template that fails on
    it (a Jinja error, a raise_exception on roles it refuses) is a DataError naming
    `where` (the row's origin): every method renders every chat row while preparing.
    template: another template than the tokenizer's (chat_template.training_version)."""
    import jinja2

    try:
        return list(tokenizer.apply_chat_template(messages, tokenize=True, return_dict=True,
                                                  add_generation_prompt=generation_prompt,
                                                  tools=tools or None,
                                                  chat_template=template)
                    ["input_ids"])
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise chat_template.cannot_render(where, exc) from None


def require_chat_template(splits, tokenizer: PreTrainedTokenizerBase,
                          experiment: Experiment) -> None:
    """Message-list rows are rendered by the tokenizer's chat template: without one, say
    so before any row is tokenized, naming the data and the setting that gives one."""
    if tokenizer.chat_template:
        return
    for split, rows in (("train", splits.train), ("eval", splits.eval)):
        if rows is not None and len(rows) and chat_template.conversational(rows[0]):
            raise chat_template.missing(split, experiment)
