"""The chat template that renders rows in chat format: which one (tokenizer.chat_template,
else the tokenizer's own) and training's errors when there is none or it cannot render
the rows. Training (model/tokenizer.py) raises them from here, and `finetune validate`
(data/scan.py) checks the same before anything heavy loads, reading the tokenizer's files
as JSON instead of loading it. Torch-free: jinja and transformers' chat-template module
(no torch) are imported only when a template is rendered."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from finetune.config import paths
from finetune.config.schema import Experiment
from finetune.errors import DataError, RunError, one_line, shown

# The columns TRL reads conversations from (trl.data_utils.is_conversational's, which
# cannot be imported without torch).
CHAT_COLUMNS = ("prompt", "chosen", "rejected", "completion", "messages")
# The tokens a template sees by name (transformers' special_tokens_map).
SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token",
                  "cls_token", "mask_token")
# Where transformers finds a tokenizer's own template besides tokenizer_config.json.
TEMPLATE_FILES = ("chat_template.jinja", "chat_template.json")
TEMPLATE_DIR = "additional_chat_templates"


def conversational(row: dict[str, Any]) -> bool:
    """A row in chat format: a chat column holding a list of role messages."""
    return any(isinstance(value, list) and value and isinstance(value[0], dict)
               and "role" in value[0] for value in (row.get(key) for key in CHAT_COLUMNS))


def training_version(processing_class) -> str | None:
    """TRL's training version of the tokenizer's (or processor's) template, where TRL 1.16
    ships one (trl/chat_templates: Llama 3's, Qwen2.5's, Qwen3's, Gemma's, Qwen2.5-VL's,
    ...): it renders as the original does, but with {% generation %} markers and
    prefix-preserving (Qwen3's keeps every assistant turn's think block, where the
    original drops those before the last user turn). None where TRL ships none, or the
    template has its markers already."""
    from trl.chat_template_utils import get_training_chat_template, has_generation_markers

    own = processing_class.chat_template
    if not own or has_generation_markers(own):
        return None
    try:
        return get_training_chat_template(processing_class)
    except ValueError:  # TRL knows no training version of this template
        return None


def setting(experiment: Experiment) -> str | None:
    """tokenizer.chat_template's template: inline, or the text of its file."""
    template = experiment.tokenizer.chat_template
    if not template or "{{" in template or "{%" in template:
        return template or None
    try:
        return Path(template).read_text()
    except (OSError, UnicodeDecodeError) as exc:
        raise RunError(f"tokenizer.chat_template: cannot read {shown(template)}: "
                       f"{exc}") from None


def missing(split: str, experiment: Experiment) -> DataError:
    sources = getattr(experiment.data, split) or experiment.data.train  # eval_fraction
    files = ", ".join(s.path for s in sources)
    source = experiment.tokenizer.name_or_path or experiment.model.name_or_path
    return DataError(
        f"data.{split} ({files}): the rows are message lists (chat format), and the "
        f"tokenizer of {source!r} has no chat template to render them: set "
        "tokenizer.chat_template (a Jinja template inline, or the path of a .jinja "
        "file), or give the data as plain text (`text` rows, or `prompt`/`completion` as "
        "text, with `images` for a vision-language model)")


def cannot_render(where: str, exc: Exception) -> DataError:
    return DataError(f"{where}: the chat template cannot render it ({type(exc).__name__}: "
                     f"{one_line(str(exc))}); fix the row, or the template "
                     "(tokenizer.chat_template)")


def _tokenizer_config(experiment: Experiment) -> tuple[Path, dict[str, Any]] | None:
    """The local tokenizer directory and its tokenizer_config.json; None for a hub id or
    files that cannot be read (training reads them)."""
    directory = Path(experiment.tokenizer.name_or_path or experiment.model.name_or_path)
    try:
        config = json.loads((directory / "tokenizer_config.json").read_text())
    except (OSError, ValueError):
        return None
    return (directory, config) if isinstance(config, dict) else None


def _has_own(directory: Path, config: dict[str, Any]) -> bool:
    return bool(config.get("chat_template")) or \
        any(paths.is_file(directory / name) for name in TEMPLATE_FILES) or \
        (paths.is_dir(directory / TEMPLATE_DIR) and any((directory / TEMPLATE_DIR).glob("*.jinja")))


def _tokens(experiment: Experiment, config: dict[str, Any]) -> dict[str, str]:
    """The special tokens by name, as the loaded tokenizer gives them to its template
    (finetune's pad token included: model/tokenizer.py)."""
    tokens = {}
    for name in SPECIAL_TOKENS:
        value = config.get(name)
        value = value.get("content") if isinstance(value, dict) else value
        if isinstance(value, str):
            tokens[name] = value
    pad = experiment.tokenizer.pad_token or tokens.get("pad_token") or tokens.get("eos_token")
    return {**tokens, "pad_token": pad} if pad else tokens


def render(template: str, messages: list[dict[str, Any]], where: str,
           tokens: dict[str, str] | None) -> None:
    """Render one conversation through the template as the tokenizer does (transformers'
    own renderer): a DataError naming `where` if it cannot. tokens None: the special
    tokens are not known here, so a name left undefined is not the template's fault."""
    import jinja2
    from transformers.utils.chat_template_utils import render_jinja_template

    plain = [{k: v for k, v in m.items() if v is not None} for m in messages]
    try:
        render_jinja_template([plain], chat_template=template, **(tokens or {}))
    except jinja2.UndefinedError as exc:
        if tokens is not None:
            raise cannot_render(where, exc) from None
    except (jinja2.TemplateError, ValueError, TypeError) as exc:
        raise cannot_render(where, exc) from None


class RowRenderer:
    """validate: training's verdict on the chat template, row by row (training renders
    every row): rows in chat format need a template (finish() says so, after every row is
    read, as training reads them before it renders), and tokenizer.chat_template must
    render each of them. A tokenizer whose files cannot be read here (a hub id) is left to
    training, but for rendering the experiment's own template."""

    def __init__(self, experiment: Experiment):
        self.experiment, self.template = experiment, setting(experiment)
        self.found = _tokenizer_config(experiment)
        self.tokens = _tokens(experiment, self.found[1]) if self.found else None
        self.first_chat: str | None = None  # the first split with a row in chat format
        self.rendered = 0

    def __call__(self, split: str, where: str, row: dict[str, Any]) -> None:
        if not conversational(row):
            return
        self.first_chat = self.first_chat or split
        if self.template is None:
            return
        prompt = row.get("prompt") if isinstance(row.get("prompt"), list) else []
        # as training renders them: the conversation (prompt and its answer), and a
        # preference row's prompt with its rejected answer too
        first = prompt + [m for key in ("messages", "completion", "chosen")
                          if isinstance(row.get(key), list) for m in row[key]]
        for messages in [first] + ([prompt + row["rejected"]]
                                   if isinstance(row.get("rejected"), list) else []):
            render(self.template, messages, where, self.tokens)
        self.rendered += 1

    def finish(self) -> None:
        if self.first_chat and self.template is None and self.found is not None \
                and not _has_own(*self.found):
            raise missing(self.first_chat, self.experiment)
