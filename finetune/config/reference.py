"""The experiment reference, generated from the schema's field descriptions
(docs/experiment.md is this output; a test keeps them equal)."""

from __future__ import annotations

import re
import typing

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

from finetune.config import yamltext
from finetune.config.methods import METHODS
from finetune.config.schema import Experiment
from finetune.config.section import Section


def _type_name(annotation) -> str:
    text = str(annotation).replace("typing.", "")
    # A list item's path mark (config/inputs.py): the descriptions say what the path is.
    text = re.sub(r"Annotated\[([^\[\]]*), (?:Input|Output)\([^()]*\)\]", r"\1", text)
    for prefix in ("finetune.config.schema.", "<class '"):
        text = text.replace(prefix, "")
    return text.replace("'>", "").replace("NoneType", "None")


def _rows(model: type[BaseModel], prefix: str) -> list[str]:
    rows = []
    for name, field in model.model_fields.items():
        sub = next((a for a in (field.annotation, *typing.get_args(field.annotation))
                    if isinstance(a, type) and issubclass(a, Section)), None)
        if sub is not None and sub is not model and not typing.get_origin(field.annotation) is list:
            rows += _rows(sub, f"{prefix}{name}.")
            continue
        if field.default is not PydanticUndefined:
            default = f"`{field.default!r}`"
        elif field.default_factory is not None:
            default = f"`{field.default_factory()!r}`"
        else:
            default = "required"
        kind = _type_name(field.annotation).replace("|", "\\|")
        description = (field.description or "").replace("|", "\\|")
        rows.append(f"| `{prefix}{name}` | {kind} | {default} | {description} |")
        if sub is not None:  # a list of sections: document the item's fields too
            rows += _rows(sub, f"{prefix}{name}[].")
    return rows


def _model(method) -> str:
    """What a method trains, in words, from its record."""
    if method.head == "score":
        text = f"sequence classifier, a logit per class ({method.labels})" if method.labels \
            else "sequence classifier, 1 logit"
    else:
        text = "causal LM"
    if method.reference is not None:
        text += " + frozen reference"
        if method.reference.switch:
            text += f" (none when training.{method.reference.switch} is 0)"
    if method.value_model:
        text += f" + value model ({method.value_model})"
    return text


def methods_table() -> list[str]:
    """One row per method record (config/methods.py): every method, none written by hand."""
    rows = ["## Methods", "",
            "| method | `training:` fields of | data formats | model | sections | strategies |",
            "|---|---|---|---|---|---|"]
    for name, method in METHODS.items():
        sections = ", ".join(f"`{s}`" for s in method.sections) or "-"
        rows.append(f"| `{name}` | {'.'.join(method.config_class)} | "
                    f"{', '.join(method.formats)} | {_model(method)} | {sections} | "
                    f"{', '.join(method.strategies)} |")
    return rows + [""]


def markdown() -> str:
    classes = ", ".join(f"{name}: {'.'.join(method.config_class)}"
                        for name, method in METHODS.items())
    lines = ["# Experiment reference", "",
             "Generated from finetune/config/schema.py by `finetune reference`.",
             "Unknown keys are errors. `extends:` (a file or a list, relative to the file) "
             "merges bases under the file. `training:` takes any field of the method's config "
             f"class ({classes}) except those finetune "
             "sets from another section; validate checks the ranges and combinations "
             "training would refuse (batch sizes, accumulation, finite learning rate, seeds "
             "in [0, 2**32 - 1], positive lengths and epochs, GRPO's batch arithmetic) and the "
             "packages `report_to` and `model.attn_implementation` need.", "",
             f"Files are UTF-8 text of at most {yamltext.MAX_BYTES // 1024} KiB, nested at most "
             f"{yamltext.MAX_DEPTH} levels, with at most {yamltext.MAX_NODES:,} values "
             "(an alias counts as often as it is used); keys are text.", "",
             *methods_table(), "## Keys", "",
             "| key | type | default | description |", "|---|---|---|---|"]
    return "\n".join(lines + _rows(Experiment, "")) + "\n"
