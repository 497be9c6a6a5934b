"""The sweep file: strictly validated like an experiment (unknown keys are errors naming
their YAML path), read as experiment files are (safe, bounded). Torch-free."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError, model_validator

from finetune.config import yamltext
from finetune.errors import ConfigError, clip, shown

# Keys the sweep sets itself for every trial: where it runs and under which name.
RESERVED = ("name", "output", "output.dir", "resume", "extends")
# The most trials one sweep runs (each is a training run, each checked before any runs).
MAX_TRIALS = 10_000


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)


class Parameter(_Strict):
    """`values: [...]`, or a range `low`..`high` (random and tpe), uniform or log-uniform."""

    values: list[Any] | None = None
    low: float | None = None
    high: float | None = None
    log: bool = False
    type: Literal["float", "int"] = "float"

    @model_validator(mode="after")
    def _one_kind(self) -> "Parameter":
        ranged = self.low is not None or self.high is not None
        if self.values is not None:
            if ranged or self.log or "type" in self.model_fields_set:
                raise ValueError("give either values: [...] or low/high (with log, type), "
                                 "not both")
            if not self.values:
                raise ValueError("values: an empty list")
            odd = next((v for v in self.values if not isinstance(v, (str, bool, int, float))
                        and v is not None), None)
            if odd is not None:
                raise ValueError(f"values: each a single value (text, number, true/false, "
                                 f"null), not {odd!r:.60}")
            return self
        if self.low is None or self.high is None:
            raise ValueError("expected values: [...], or both low and high")
        if self.low >= self.high:
            raise ValueError(f"low ({self.low:g}) must be below high ({self.high:g})")
        if self.log and self.low <= 0:
            raise ValueError("log: true needs low above 0")
        if self.type == "int" and not (self.low.is_integer() and self.high.is_integer()):
            raise ValueError("type: int needs whole numbers for low and high")
        return self

    @property
    def ranged(self) -> bool:
        return self.values is None


class Prune(_Strict):
    """Median pruning (Optuna's MedianPruner rule): at an evaluation step, a trial whose
    metric is worse than the median of the finished trials' metric at that step stops."""

    median: Literal[True] = True
    min_trials: int = 2  # finished trials needed before any pruning
    warmup_steps: int = 0  # no pruning before this step

    @model_validator(mode="after")
    def _counts(self) -> "Prune":
        if self.min_trials < 1 or self.warmup_steps < 0:
            raise ValueError("min_trials must be at least 1 and warmup_steps at least 0")
        return self


class Sweep(_Strict):
    method: Literal["grid", "random", "tpe"]
    parameters: dict[str, Parameter]
    metric: str
    goal: Literal["minimize", "maximize"]
    trials: int | None = None
    seed: int = 0
    startup_trials: int | None = None  # tpe: random trials before TPE models the rest
    prune: Prune | None = None

    @model_validator(mode="after")
    def _fits_method(self) -> "Sweep":
        if not self.parameters:
            raise ValueError("parameters: none given")
        if self.method == "grid":
            if self.trials is not None:
                raise ValueError("trials: a grid runs every combination of the values; "
                                 "leave trials out (or use method random or tpe)")
            ranged = [key for key, p in self.parameters.items() if p.ranged]
            if ranged:
                raise ValueError(f"parameters.{ranged[0]}: a grid needs values: [...], "
                                 "not a low/high range")
            # Counted, never built: a grid of millions would fill the memory first.
            count = math.prod(len(p.values) for p in self.parameters.values())
            if count > MAX_TRIALS:
                raise ValueError(
                    f"parameters: a grid of {count:,} trials (the product of the number of "
                    f"values of each parameter), more than the {MAX_TRIALS:,} a sweep runs: "
                    f"use method random with trials: N (at most {MAX_TRIALS:,}), which "
                    "draws from the same values, or give fewer values")
        elif self.trials is None or not 1 <= self.trials <= MAX_TRIALS:
            raise ValueError(f"trials: method {self.method} needs a number of trials "
                             f"(1..{MAX_TRIALS})")
        if self.startup_trials is not None and (self.method != "tpe" or self.startup_trials < 1):
            raise ValueError("startup_trials: only for method tpe, and at least 1")
        return self

    def canonical(self) -> str:
        """What a rerun must match: the sweep as validated, every default filled."""
        return json.dumps(self.model_dump(mode="json"), sort_keys=True)


def _where(loc: tuple) -> str:
    return ".".join(clip(str(part)) for part in loc)


def read_sweep(path: Path) -> Sweep:
    """The sweep file read as experiment files are (config/yamltext.py: a safe loader,
    bounded, numbers such as 1e-4 typed as numbers, errors naming file and line)."""
    try:
        with path.open("rb") as file:
            raw = file.read(yamltext.MAX_BYTES + 1)
    except FileNotFoundError:
        raise ConfigError([f"{path}: no such sweep file"]) from None
    except OSError as exc:
        raise ConfigError([f"{path}: cannot read the sweep file: {exc.strerror}"]) from None
    _, data = yamltext.compose(yamltext.decode(raw, str(path)), str(path))
    if not isinstance(data, dict):
        raise ConfigError([f"{path}: a sweep file is a mapping (method, parameters, metric, "
                           "goal ...)"])
    problems = []
    for key in (data.get("parameters") or {}) if isinstance(data.get("parameters"), dict) else ():
        if not isinstance(key, str) or not key:
            problems.append(f"{path}: parameters: {shown(key)} is not a dotted experiment key")
        elif key in RESERVED or key.startswith("output."):
            problems.append(f"{path}: parameters.{clip(key)}: set by the sweep for each trial "
                            "(its run directory, name and resume); not a parameter")
    if problems:
        raise ConfigError(problems)
    try:
        return Sweep.model_validate(data)
    except ValidationError as exc:
        raise ConfigError([_problem(path, err) for err in exc.errors()]) from None


def _problem(path: Path, error: dict[str, Any]) -> str:
    where = _where(tuple(error["loc"]))
    if error["type"] == "extra_forbidden":
        message = "unknown key"
    elif error["type"] == "missing":
        message = "required, but missing"
    elif error["type"] == "value_error":
        message = str(error["ctx"]["error"])
    else:
        message = f"{error['msg']} (got {shown(error.get('input'))})"
    return f"{path}: {where}: {message}" if where else f"{path}: {message}"
