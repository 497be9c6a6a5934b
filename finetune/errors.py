"""Errors a user can act on. The CLI prints them as one line each and exits 2."""

from __future__ import annotations


class ConfigError(Exception):
    """One or more problems in an experiment, each naming its YAML path."""

    def __init__(self, problems: list[str]):
        self.problems = list(problems)
        super().__init__("\n".join(self.problems))


class DataError(Exception):
    """A bad data file or row; the message names the file and the row."""


class RunError(Exception):
    """A run cannot start or continue (run directory, device, checkpoint)."""
