"""The pieces of the `finetune` command line shared by the modules that add subcommands:
argparse types that check a value where it is typed, and a parser whose errors are one
`error:` line. Torch-free."""

from __future__ import annotations

import argparse
import sys

EXIT_USER_ERROR = 2


def whole(low: int, high: int | None = None):
    """argparse type: a whole number in [low, high], else argparse's one-line error."""
    def parse(text: str) -> int:
        import re

        if not re.fullmatch(r"[+-]?[0-9]{1,9}", text.strip()):
            raise argparse.ArgumentTypeError(f"expected a whole number, got {text!r}")
        value = int(text)
        if value < low or (high is not None and value > high):
            span = f"{low}..{high}" if high is not None else f"at least {low}"
            raise argparse.ArgumentTypeError(f"must be {span}, got {value}")
        return value

    parse.__name__ = "whole number"
    return parse


def checked(problem_of):
    """argparse type from a config/script_values check (torch-free, imported when parsing)."""
    def parse(text: str) -> str:
        from finetune.config import script_values as values

        problem = getattr(values, problem_of)(text)
        if problem:
            raise argparse.ArgumentTypeError(f"{text!r}: {problem}")
        return text

    return parse


def time_limit(text: str) -> str:
    from finetune.config.script_values import time_seconds

    try:
        time_seconds(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


class Parser(argparse.ArgumentParser):
    """argparse, but a bad flag is one `error:` line like every other user error (its
    own error() prints the whole usage first)."""

    def error(self, message: str):
        print(f"error: {self.prog}: {message} (see {self.prog} --help)", file=sys.stderr)
        raise SystemExit(EXIT_USER_ERROR)
