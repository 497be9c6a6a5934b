"""Errors a user can act on. The CLI prints them as one line each and exits 2."""

from __future__ import annotations

import re


class ConfigError(Exception):
    """One or more problems in an experiment, each naming its YAML path."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class DataError(Exception):
    """A bad data file or row; the message names the file and the row."""


class RunError(Exception):
    """A run cannot start or continue (run directory, device, checkpoint)."""


class RunFinished(Exception):
    """Nothing to do: the run finished before (a requeued job runs the same command
    again). The CLI prints it and exits 0."""


def first_line(exc: BaseException) -> str:
    """A library's error in one line of ours: its first line, control characters escaped
    (the rest is usually advice about its own setup)."""
    lines = str(exc).strip().splitlines() or [type(exc).__name__]
    return "".join(c if c.isprintable() else repr(c)[1:-1] for c in lines[0])


# Exit codes beyond the CLI's 2 (a user error). EX_TEMPFAIL, "try again later": training
# stopped on a signal after sealing a checkpoint, and continues when run again.
EXIT_PREEMPTED = 75
# The same after Ctrl-C: 128 + SIGINT, what a shell expects of an interrupted command.
EXIT_INTERRUPTED = 130
# The save asked for by a signal did not finish in preemption.save_timeout.
EXIT_SAVE_TIMEOUT = 76


def exit_code(signal_name: str) -> int:
    """How a run that saved and stopped on `signal_name` exits."""
    return EXIT_INTERRUPTED if signal_name == "SIGINT" else EXIT_PREEMPTED


# Written by a training process that stopped on one of the errors above, so that
# `finetune launch`, whose launcher only reports "a child failed", can exit 2 as well.
FAILED_MARKER = "failed.json"


def one_line(text: str) -> str:
    """Foreign text (a reader's error, a name from the data) in one error line: line
    breaks and other control characters escaped, so none can start a line of its own."""
    return "".join(c if c.isprintable() else c.encode("unicode_escape").decode() for c in text)


# How much of what the user wrote an error line echoes: a key, a value (paths included).
KEY_CHARS, VALUE_CHARS = 80, 200


def clip(text: str, limit: int = KEY_CHARS) -> str:
    """A key or value the user wrote, shortened to about `limit` characters in an error
    line: a 10 kB key is named by its start and its length, not echoed whole."""
    if len(text) <= limit:
        return text
    head = text[:max(limit - 24, 8)]
    # Never cut inside a URL's user:password@ (the credential scrub needs the `@`).
    opened = re.search(r"://[^\s/@]*$", head)
    if opened and "@" in text[len(head):]:
        head = head[:opened.start() + 3]
    return f"{head}... ({len(text):,} characters)"


def shown(value: object, limit: int = VALUE_CHARS) -> str:
    """A value as an error line echoes it: its repr, clipped."""
    return clip(repr(value), limit)
