"""Reward sources for grpo and ppo: Python functions named 'module:function' (or
'file.py:function') and a reward model (a `method: reward` run directory or a model)."""

from __future__ import annotations

import importlib
import importlib.util
import math
import numbers
from pathlib import Path
from typing import Any, Callable

import torch
import yaml

from finetune.config.schema import Experiment
from finetune.errors import ConfigError, RunError

RewardFunction = Callable[..., list]


def import_function(spec: str, where: str) -> RewardFunction:
    """The function 'module:function' or 'file.py:function' names; ConfigError naming
    `where` when it cannot be imported."""
    module_name, _, function_name = spec.rpartition(":")
    try:
        if module_name.endswith(".py"):
            path = Path(module_name)
            loader = importlib.util.spec_from_file_location(f"finetune_rewards_{path.stem}", path)
            module = importlib.util.module_from_spec(loader)
            loader.loader.exec_module(module)
        else:
            module = importlib.import_module(module_name)
    except Exception as exc:  # the user's module: any error it raises is theirs to see
        raise ConfigError([f"{where}: cannot import {module_name}: "
                           f"{type(exc).__name__}: {exc}"]) from None
    function = getattr(module, function_name, None)
    if not callable(function):
        raise ConfigError([f"{where}: {module_name} has no function {function_name!r}"])
    return function


def reward_functions(experiment: Experiment) -> list[RewardFunction]:
    return [import_function(spec, f"rewards.functions[{i}]")
            for i, spec in enumerate(experiment.rewards.functions)]


def unique_names(names: list[str]) -> list[str]:
    """Metric names per reward source: a repeated name gets _2, _3, ..."""
    seen: dict[str, int] = {}
    out = []
    for name in names:
        seen[name] = seen.get(name, 0) + 1
        out.append(name if seen[name] == 1 else f"{name}_{seen[name]}")
    return out


def reward_problem(output: Any, count: int, allow_none: bool) -> str | None:
    """Why a reward function's result is unusable, or None. None values mean "not scored
    by this function" where the method allows it (grpo), and are refused otherwise (ppo
    needs every completion scored)."""
    if isinstance(output, torch.Tensor):
        output = output.tolist()
    unit = "one number (or None)" if allow_none else "one number"
    if isinstance(output, (str, bytes)) or not hasattr(output, "__len__"):
        return f"returned {type(output).__name__}, not a list of {unit} per completion"
    if len(output) != count:
        return f"returned {len(output)} rewards for {count} completions"
    for i, value in enumerate(output):
        if value is None:
            if allow_none:
                continue
            return f"returned None at index {i}; ppo and best-of-n need a reward for " \
                   "every completion"
        if isinstance(value, bool) or not isinstance(value, numbers.Real):
            return f"returned {type(value).__name__} {value!r} at index {i}; rewards are " \
                   f"numbers{', or None for a completion it does not score' if allow_none else ''}"
        if not math.isfinite(value):
            return f"returned {value} at index {i}; rewards must be finite"
    return None


def reward_call_error(exc: Exception, where: str) -> RunError:
    """The error for a reward function that raised: whose, and the usual fix."""
    hint = ""
    if isinstance(exc, TypeError) and "argument" in str(exc):
        hint = " (reward functions are called as f(prompts=..., completions=..., " \
               "completion_ids=..., **columns); accept **kwargs)"
    return RunError(f"{where} raised {type(exc).__name__}: {exc}{hint}")


def reward_weights(experiment: Experiment) -> list[float]:
    spec = experiment.rewards
    count = (spec.model is not None) + len(spec.functions)
    return list(spec.weights) if spec.weights is not None else [1.0] * count


def _from_run(run_dir: Path) -> tuple[str, str | None]:
    """(model to load, adapter or None) of a finished `method: reward` run."""
    resolved = yaml.safe_load((run_dir / "experiment.yaml").read_text())
    if resolved.get("method") != "reward":
        raise RunError(f"rewards.model: {run_dir} is a {resolved.get('method')} run, not a "
                       "reward run")
    final = run_dir / "final"
    if not (final / "config.json").is_file() and not (final / "adapter_config.json").is_file():
        raise RunError(f"rewards.model: {run_dir} has no final/ model yet; finish the "
                       "reward run first")
    if not (final / "adapter_config.json").is_file():
        return str(final), None
    model = resolved["model"]
    base = str(run_dir / "init-model") if model.get("init") == "random" else model["name_or_path"]
    return base, str(final)


def reward_model(experiment: Experiment, dtype: torch.dtype) -> tuple[Any, Any]:
    """(model, tokenizer) of rewards.model, frozen, in eval mode, loaded in `dtype` (the
    run's dtype for reward models: Hardware.model_dtype). LoRA reward runs are merged
    into their base."""
    from transformers import AutoModelForSequenceClassification, AutoTokenizer

    path = Path(experiment.rewards.model)
    source, adapter = (_from_run(path) if (path / "experiment.yaml").is_file()
                       else (str(path), None))
    tokenizer_source = str(path / "final") if adapter or source.endswith("final") else source
    trust = experiment.model.trust_remote_code
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source, trust_remote_code=trust)
    if tokenizer.pad_token is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForSequenceClassification.from_pretrained(
        source, num_labels=1, dtype=dtype, trust_remote_code=trust,
        pad_token_id=tokenizer.pad_token_id)
    if adapter:
        from peft import PeftModel

        model = PeftModel.from_pretrained(model, adapter).merge_and_unload()
    model.requires_grad_(False)
    return model.eval(), tokenizer
