"""What every section of the experiment schema shares: the base model (unknown keys and
non-finite numbers refused), the value checks several sections use, and the per-method
wording of descriptions generated from the method records."""

from __future__ import annotations

import re

from pydantic import BaseModel, ConfigDict

from finetune.config import methods
from finetune.config.script_values import control_problem


class Section(BaseModel):
    # NaN and infinity are no setting's value (pydantic's float takes them by default).
    model_config = ConfigDict(extra="forbid", validate_default=True, allow_inf_nan=False)


# A branch, tag or commit as the hub names them (git's ref rules, simplified).
REVISION_RE = re.compile(r"(?!.*\.\.)[A-Za-z0-9][A-Za-z0-9._/-]{0,199}")


def check_revision(value: str | None) -> str | None:
    if value is not None and not REVISION_RE.fullmatch(value):
        raise ValueError("not a branch, tag or commit name (letters, digits, '.', '_', '-', "
                         "'/'; at most 200)")
    return value


# A hub repository: [namespace/]name, each at most 96 letters, digits, '.', '_', '-'.
REPO_ID_RE = re.compile(r"([A-Za-z0-9][\w.-]{0,95}/)?[A-Za-z0-9][\w.-]{0,95}")


def check_repo_id(value: str | None) -> str | None:
    if value is not None and (not REPO_ID_RE.fullmatch(value) or ".." in value
                              or value.endswith((".git", "."))):
        raise ValueError("not a hub repository id: [namespace/]name, letters, digits, '.', "
                         "'_', '-' (at most 96 each)")
    return value


def check_no_control(value: str | None) -> str | None:
    problem = value and control_problem(value)  # written into generated files
    if problem:
        raise ValueError(problem)
    return value


def by_method(describe) -> str:
    """'sft: A; reward and dpo: B; ...': describe(record) per group of methods sharing it."""
    groups: dict[str, list[str]] = {}
    for record in methods.METHODS.values():
        groups.setdefault(describe(record), []).append(record.name)
    return "; ".join(f"{methods.spoken(names)}: {text}" for text, names in groups.items())


def for_methods(wanted) -> str:
    """'sft, reward: ' for the methods whose record satisfies wanted(record)."""
    return ", ".join(methods.names_where(wanted)) + ": "
