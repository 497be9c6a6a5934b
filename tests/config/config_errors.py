"""What the config tests ask of an experiment: the problems loading it reports, and what
`finetune validate` answers (exit 0, or exit 2 with one `error:` line each, no traceback)."""

from __future__ import annotations

import pytest

from finetune.cli import main
from finetune.config import load_experiment
from finetune.errors import ConfigError


def problems(path, *overrides) -> list[str]:
    """load_experiment(path, overrides) must fail: its problems, one string each."""
    with pytest.raises(ConfigError) as info:
        load_experiment(path, overrides)
    return info.value.problems


def validate(capsys, path, *overrides):
    """`finetune validate` in-process: (exit code, error lines). Any other exception
    than SystemExit escaping main() fails the test with its traceback. No clock: a hostile
    input's bound is the budget its error names (files read, nodes, values), which a
    loaded machine cannot miss."""
    capsys.readouterr()
    code = main(["validate", str(path), *overrides])
    err = capsys.readouterr().err
    assert code in (0, 2)
    lines = err.splitlines()
    if code == 2:
        assert lines and all(line.startswith("error: ") for line in lines), err
    assert "Traceback" not in err
    return code, lines


def refused(capsys, path, *overrides, **kw) -> str:
    """`finetune validate` must exit 2: its error lines, joined."""
    code, lines = validate(capsys, path, *overrides, **kw)
    assert code == 2
    return "\n".join(lines)
