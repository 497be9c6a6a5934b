"""The rewards of `finetune generate --best-of`: --reward flags (a reward run directory, a
reward model directory, 'module:function' or 'file.py:function', repeatable, weighted by
--reward-weights in the flags' order), or else the `rewards:` section of the run's own
experiment (grpo, ppo and rloo runs have one). Everything is checked, and every function
imported, before a model is loaded; a problem names the flag (or the run's
experiment.yaml) and exits 2.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from finetune.config.rules import FUNCTION_RE
from finetune.errors import ConfigError, RunError
from finetune.model.saved import read_experiment


@dataclass(frozen=True)
class RewardSources:
    model: str | None        # a `method: reward` run directory, or a model directory
    functions: list[str]     # 'module:function' / 'file.py:function', in order
    callables: list          # the functions themselves, imported
    weights: list[float]     # the model's first, then each function's
    where: str               # what to name in an error: --reward, or the run's rewards

    def describe(self) -> str:
        parts = ([f"model {self.model}"] if self.model else []) + self.functions
        return ", ".join(f"{w:g} x {p}" for w, p in zip(self.weights, parts))


def _model_problem(path: Path) -> str | None:
    """Why directory `path` is not a reward model finetune can load, or None."""
    if (path / "experiment.yaml").is_file():
        method = read_experiment(path).method
        if method != "reward":
            return f"{path} is a {method} run, not a `method: reward` run"
        final = path / "final"
        if not (final / "config.json").is_file() and not (final / "adapter_config.json").is_file():
            return f"{path} has no final/ model yet; finish the reward run first"
        return None
    config_file = path / "config.json"
    if not config_file.is_file():
        kind = "a PEFT adapter; give the reward run's directory" if \
            (path / "adapter_config.json").is_file() else "neither a run nor a model"
        return f"{path} is {kind}"
    try:
        config = json.loads(config_file.read_text())
    except (OSError, ValueError) as exc:
        return f"{config_file}: cannot read it ({exc})"
    heads = [a for a in config.get("architectures") or []
             if a.endswith("ForSequenceClassification")]
    labels = len(config.get("id2label") or {0: 0, 1: 1})
    if not heads or labels != 1:
        return f"{path} is not a reward model: it needs a sequence-classification head with " \
               f"one label (architectures {config.get('architectures')}, {labels} label(s))"
    return None


def _function(spec: str, where: str, problems: list[str]):
    from finetune.model.rewards import import_function

    if ".py:" in spec and not Path(spec.rpartition(":")[0]).is_file():
        problems.append(f"{where}: no such file: {spec.rpartition(':')[0]}")
        return None
    try:
        return import_function(spec, where)
    except ConfigError as exc:
        problems.extend(exc.problems)
        return None


def from_flags(specs: list[str], weights: list[float] | None) -> RewardSources:
    """--reward (repeated) and --reward-weights, checked."""
    problems: list[str] = []
    models, functions, callables, function_weights, model_weight = [], [], [], [], 1.0
    for i, spec in enumerate(specs):
        where = f"--reward {spec}"
        weight = weights[i] if weights is not None and i < len(weights) else 1.0
        if Path(spec).is_dir():
            problem = _model_problem(Path(spec))
            if problem:
                problems.append(f"{where}: {problem}")
            models.append(str(Path(spec).absolute()))
            model_weight = weight
        elif FUNCTION_RE.fullmatch(spec):
            functions.append(spec)
            callables.append(_function(spec, where, problems))
            function_weights.append(weight)
        else:
            problems.append(f"{where}: no such directory, and not 'module:function' or "
                            "'file.py:function'")
    if len(models) > 1:
        problems.append(f"--reward: {len(models)} reward models; give at most one (and any "
                        "number of functions)")
    if weights is not None and len(weights) != len(specs):
        problems.append(f"--reward-weights: {len(weights)} weight(s) for {len(specs)} --reward "
                        "source(s) (one each, in the order of the --reward flags)")
    if problems:
        raise ConfigError(problems)
    model = models[0] if models else None
    return RewardSources(model, functions, callables,
                         ([model_weight] if model else []) + function_weights, "--reward")


def from_run(run_dir: Path, experiment) -> RewardSources:
    """The rewards: section of the run's own experiment (paths already resolved)."""
    spec = experiment.rewards
    where = f"{run_dir / 'experiment.yaml'} rewards"
    if spec.model is None and not spec.functions:
        raise RunError(f"--reward is needed: {run_dir} is a {experiment.method} run and its "
                       "experiment has no rewards: section to score completions with")
    problems: list[str] = []
    if spec.model is not None and Path(spec.model).is_dir():
        problem = _model_problem(Path(spec.model))
        if problem:
            problems.append(f"{where}.model: {problem}")
    callables = [_function(name, f"{where}.functions[{i}] ({name})", problems)
                 for i, name in enumerate(spec.functions)]
    if problems:
        raise ConfigError(problems)
    count = (spec.model is not None) + len(spec.functions)
    weights = list(spec.weights) if spec.weights is not None else [1.0] * count
    return RewardSources(spec.model, list(spec.functions), callables, weights, where)

