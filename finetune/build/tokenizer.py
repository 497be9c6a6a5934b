"""The tokenizer, its chat template and its padding token."""

from __future__ import annotations

from pathlib import Path

from transformers import AutoTokenizer, PreTrainedTokenizerBase

from finetune.build.model import refuse_remote_code, remote_code_error
from finetune.config.schema import Experiment
from finetune.errors import DataError, RunError, first_line


def load_tokenizer(experiment: Experiment) -> PreTrainedTokenizerBase:
    source = experiment.tokenizer.name_or_path or experiment.model.name_or_path
    key = "tokenizer.name_or_path" if experiment.tokenizer.name_or_path else "model.name_or_path"
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
    template = experiment.tokenizer.chat_template
    if template:
        is_inline = "{{" in template or "{%" in template
        try:
            tokenizer.chat_template = template if is_inline else Path(template).read_text()
        except (OSError, UnicodeDecodeError) as exc:
            raise RunError(f"tokenizer.chat_template: cannot read {template!r}: {exc}") from None
    if experiment.tokenizer.pad_token:
        tokenizer.pad_token = experiment.tokenizer.pad_token
    elif tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    return tokenizer


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


def require_chat_template(splits, tokenizer: PreTrainedTokenizerBase,
                          experiment: Experiment) -> None:
    """Message-list rows are rendered by the tokenizer's chat template: without one, say
    so before any row is tokenized, naming the data and the setting that gives one."""
    from trl.data_utils import is_conversational

    for split, rows in (("train", splits.train), ("eval", splits.eval)):
        if rows is None or len(rows) == 0 or not is_conversational(rows[0]):
            continue
        sources = getattr(experiment.data, split) or experiment.data.train  # eval_fraction
        files = ", ".join(s.path for s in sources)
        source = experiment.tokenizer.name_or_path or experiment.model.name_or_path
        if tokenizer.chat_template:
            _render_first(tokenizer, rows[0], f"data.{split} ({files}) row 1")
            continue
        raise DataError(
            f"data.{split} ({files}): the rows are message lists (chat format), and the "
            f"tokenizer of {source!r} has no chat template to render them: set "
            "tokenizer.chat_template (a Jinja template inline, or the path of a .jinja "
            "file), or give the data as plain text")


def _render_first(tokenizer: PreTrainedTokenizerBase, row: dict, where: str) -> None:
    """A template that cannot render the data (a Jinja error, a role it refuses) fails on
    the first row already: say so here, not from inside the tokenization of every row."""
    import jinja2

    lists = {k: v for k, v in row.items()
             if isinstance(v, list) and v and isinstance(v[0], dict)}
    prompt = lists.pop("prompt", [])
    # Rendered as the methods render them: the prompt, then each answer after it.
    conversations = {f"prompt + {k}" if prompt else k: prompt + v for k, v in lists.items()}
    for column, value in (conversations or {"prompt": prompt}).items():
        try:
            tokenizer.apply_chat_template(value, tokenize=False)
        except (jinja2.TemplateError, ValueError, TypeError) as exc:
            raise DataError(f"{where}, `{column}`: the chat template cannot render it "
                            f"({type(exc).__name__}: {exc}); fix the template or give "
                            "another with tokenizer.chat_template") from None
