"""Which parameters each trial takes: every combination (grid), seeded random draws
(random), or Optuna's TPE given the trials so far (tpe). Torch-free; optuna is imported
only for tpe."""

from __future__ import annotations

import itertools
import json
import math
import random
from typing import Any

from finetune.errors import ConfigError
from finetune.sweep.spec import Parameter, Sweep

OPTUNA_EXTRA = "method tpe needs Optuna: pip install 'finetune[sweep]' (or pip install optuna)"


def override(key: str, value: Any) -> str:
    """key=value as `finetune train` takes it: JSON is read back by YAML as the same value
    (a text `yes` stays text, 1e-05 a number)."""
    return f"{key}={json.dumps(value)}"


def planned(sweep: Sweep) -> list[dict[str, Any]] | None:
    """Every trial's parameters, known before any runs (grid, random); None for tpe."""
    if sweep.method == "grid":
        keys = list(sweep.parameters)
        return [dict(zip(keys, combo)) for combo in
                itertools.product(*(sweep.parameters[k].values for k in keys))]
    if sweep.method == "random":
        rng = random.Random(sweep.seed)
        return [{key: _draw(rng, p) for key, p in sweep.parameters.items()}
                for _ in range(sweep.trials)]
    return None


def _draw(rng: random.Random, p: Parameter) -> Any:
    if not p.ranged:
        return rng.choice(p.values)
    if p.type == "int":
        low, high = int(p.low), int(p.high)
        if not p.log:
            return rng.randint(low, high)
        # log-uniform over [low, high + 1), floored: each whole number its share
        return min(high, int(math.exp(rng.uniform(math.log(low), math.log(high + 1)))))
    if p.log:
        return math.exp(rng.uniform(math.log(p.low), math.log(p.high)))
    return rng.uniform(p.low, p.high)


def endpoints(p: Parameter) -> list[Any]:
    """The values that stand for a parameter when it is checked before any trial runs."""
    if not p.ranged:
        return list(p.values)
    if p.type == "int":
        return [int(p.low), int(p.high)]
    return [p.low, p.high]


def require_optuna() -> None:
    try:
        import optuna  # noqa: F401
    except ImportError:
        raise ConfigError([OPTUNA_EXTRA]) from None


def _distributions(sweep: Sweep) -> dict[str, Any]:
    from optuna.distributions import (CategoricalDistribution, FloatDistribution,
                                      IntDistribution)

    out = {}
    for key, p in sweep.parameters.items():
        if not p.ranged:
            out[key] = CategoricalDistribution(p.values)
        elif p.type == "int":
            out[key] = IntDistribution(int(p.low), int(p.high), log=p.log)
        else:
            out[key] = FloatDistribution(p.low, p.high, log=p.log)
    return out


def tpe_next(sweep: Sweep, history: list[dict[str, Any]], number: int) -> dict[str, Any]:
    """TPE's suggestion for trial `number`, from a study rebuilt from the sweep's record
    (finished, pruned and failed trials), so a resumed sweep suggests what an uninterrupted
    one would have. The sampler's seed is sweep.seed + number: the same history gives the
    same suggestion, and the random start-up trials differ from each other."""
    import optuna
    from optuna.trial import TrialState, create_trial

    optuna.logging.set_verbosity(optuna.logging.WARNING)
    sampler = optuna.samplers.TPESampler(
        seed=sweep.seed + number,
        n_startup_trials=sweep.startup_trials if sweep.startup_trials is not None else 10)
    study = optuna.create_study(direction=sweep.goal, sampler=sampler)
    distributions = _distributions(sweep)
    for trial in history:
        if trial["status"] == "finished" and trial.get("metric") is not None:
            state, value = TrialState.COMPLETE, trial["metric"]
        elif trial["status"] == "pruned":
            state, value = TrialState.PRUNED, None
        elif trial["status"] == "failed":
            state, value = TrialState.FAIL, None
        else:
            continue
        steps = {int(step): v for step, v in (trial.get("intermediate") or {}).items()}
        study.add_trial(create_trial(state=state, value=value, params=trial["params"],
                                     distributions=distributions,
                                     intermediate_values=steps))
    return dict(study.ask(distributions).params)
