"""`finetune sweep EXPERIMENT SWEEP [key=value ...]`: check every trial's experiment, then
run the trials (runner.py) and report the best (results.py). Torch-free."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import Any

from finetune.errors import EXIT_PREEMPTED, ConfigError, RunError, clip, shown

NAME_WIDTH = 3  # trial-000


def add_commands(commands) -> None:
    sweep = commands.add_parser(
        "sweep", help="search hyperparameters: one run directory per trial",
        description="Run a hyperparameter search (grid, random or Optuna's TPE) over "
                    "experiment keys. Each trial is a `finetune train` (or `launch`) run "
                    "in SWEEP_DIR/trial-NNN; sweep.json records them, so the same command "
                    "continues a stopped sweep. See docs/sweeps.md.")
    sweep.add_argument("config", help="experiment YAML file")
    sweep.add_argument("sweep", help="sweep YAML file (method, parameters, metric, goal ...)")
    sweep.add_argument("overrides", nargs="*", metavar="key.sub=value",
                       help="override a setting of every trial")
    sweep.add_argument("--out", metavar="SWEEP_DIR",
                       help="sweep directory (default: the experiment's run directory "
                            "with -sweep: runs/<name>-sweep)")
    sweep.add_argument("--dry-run", action="store_true",
                       help="check every trial and print its parameters; run nothing")
    sweep.set_defaults(func=command)


def _checked(config: str, sweep_file: str, overrides: list[str], sweep) -> list[dict] | None:
    """Every parameter value (a range: its ends) is checked as `finetune validate` would,
    then every planned trial: errors name the sweep file's key before anything runs."""
    from finetune.config import load_experiment
    from finetune.sweep.search import endpoints, override, planned

    def problems_of(extra: list[str], where: str) -> list[str]:
        try:
            load_experiment(config, [*overrides, *extra])
        except ConfigError as exc:
            return [f"{sweep_file}: {where}: {p.removeprefix('command line: ')}"
                    for p in exc.problems]
        return []

    problems = [problem for key, p in sweep.parameters.items()
                for value in endpoints(p)
                for problem in problems_of([override(key, value)],
                                           f"parameters.{clip(key)}: {shown(value)}")]
    if problems:
        raise ConfigError(problems)
    plan = planned(sweep)
    for number, params in enumerate(plan or []):
        problems += problems_of([override(k, v) for k, v in params.items()],
                                f"trial {number} ({_described(params)})")
    if problems:
        raise ConfigError(problems)
    return plan


def _described(params: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4g}" if isinstance(v, float) else f"{k}={v}"
                     for k, v in params.items())


def command(args: argparse.Namespace) -> int:
    import json

    from finetune.config import load_experiment
    from finetune.rundir.paths import make_run_dir, run_dir_of
    from finetune.sweep import results, runner
    from finetune.sweep.search import require_optuna
    from finetune.sweep.spec import read_sweep

    sweep = read_sweep(Path(args.sweep))
    if sweep.method == "tpe":
        require_optuna()
    if sweep.prune is not None and ("/" in sweep.metric or not sweep.metric.startswith("eval_")):
        raise ConfigError([f"{args.sweep}: prune: needs an evaluation metric logged during "
                           f"training (eval_...), not {shown(sweep.metric)}"])
    clashes = [f"{clip(key)}: set on the command line and swept ({args.sweep}: "
               f"parameters.{clip(swept)}); "
               "each trial would take the sweep's value and drop the command line's: remove "
               "one of them" for key in (o.partition("=")[0].strip() for o in args.overrides)
               for swept in sweep.parameters
               if key == swept or swept.startswith(key + ".") or key.startswith(swept + ".")]
    if clashes:
        raise ConfigError(clashes)
    experiment = load_experiment(args.config, args.overrides)
    plan = _checked(args.config, args.sweep, args.overrides, sweep)
    total = len(plan) if plan is not None else sweep.trials
    if args.dry_run:
        for number in range(total):
            print(f"trial-{number:0{NAME_WIDTH}d}  " + (_described(plan[number]) if plan
                                                        else "chosen by TPE as trials finish"))
        print(f"finetune: {total} trial(s) checked; nothing was run")
        return 0
    sweep_dir = Path(args.out).absolute() if args.out else \
        run_dir_of(experiment).with_name(run_dir_of(experiment).name + "-sweep")
    identity = {"experiment": str(Path(args.config).absolute()), "overrides": args.overrides,
                "sweep": json.loads(sweep.canonical())}
    state = runner.load(sweep_dir)
    if state is None:
        if sweep_dir.is_dir() and any(sweep_dir.iterdir()):
            raise RunError(f"{sweep_dir} holds files but no {runner.STATE}: not a sweep "
                           "directory; nothing was changed. Choose another --out")
        make_run_dir(sweep_dir)
        state = {**identity, "metric": sweep.metric, "goal": sweep.goal, "status": "running",
                 "trials": []}
    else:
        runner.check_same(state, identity, sweep_dir)
        print(f"finetune: continuing the sweep in {sweep_dir}: "
              f"{sum(t['status'] in runner.DONE for t in state['trials'])} of {total} trials "
              "done", flush=True)
    code = _run(args, sweep, plan, total, state, sweep_dir, experiment.name)
    results.report(sweep_dir, state, f"{experiment.name} sweep ({sweep.method})")
    if code:
        return code
    print(results.table(state))
    top = results.best(state)
    if top is None:
        raise RunError(f"no trial finished with a {sweep.metric}; see the trials in {sweep_dir}")
    print(f"finetune: best {top['name']}: {sweep.metric} {top['metric']:.6g} with "
          f"{_described(top['params'])}\n  run directory {top['run_dir']}\n  table "
          f"{sweep_dir / results.RESULTS}, plot {sweep_dir / results.PLOT}")
    return 0


def _argv(args: argparse.Namespace, name: str, trial_dir: Path, params: dict[str, Any]) -> list[str]:
    """The trial's own command: the experiment with the sweep's overrides, its parameters,
    and its run directory and name. A multi-process experiment is launched."""
    from finetune.config import load_experiment
    from finetune.sweep.search import override

    overrides = [*args.overrides, *(override(k, v) for k, v in params.items()),
                 override("output.dir", str(trial_dir)), override("name", name)]
    dist = load_experiment(args.config, overrides).distributed
    how = "launch" if dist.world_size > 1 else "train"
    return [sys.executable, "-m", "finetune", how, str(Path(args.config).absolute()), *overrides]


def _run(args, sweep, plan, total, state, sweep_dir: Path, name: str) -> int:
    from finetune.sweep import results, runner
    from finetune.sweep.search import tpe_next

    trials = state["trials"]
    for trial in trials:
        runner.wait_for_leftover(trial)
    with runner.Signals() as signals:
        for number in range(total):
            if signals.received:
                break
            if number == len(trials):
                label = f"trial-{number:0{NAME_WIDTH}d}"
                params = plan[number] if plan is not None else tpe_next(sweep, trials, number)
                trials.append({"number": number, "name": label, "params": params,
                               "run_dir": str(sweep_dir / label), "status": "pending",
                               "metric": None, "exit_code": None, "pid": None})
            trial = trials[number]
            if trial["status"] in runner.DONE:
                continue
            print(f"finetune: {trial['name']} ({number + 1}/{total}): "
                  f"{_described(trial['params'])}", flush=True)
            argv = _argv(args, f"{name}-{trial['name']}", Path(trial["run_dir"]),
                         trial["params"])
            try:
                runner.run_trial(trial, argv, sweep, state, sweep_dir, signals)
            except runner.Stopped as stopped:
                state["status"] = "stopped"
                runner.save(sweep_dir, state)
                print(f"finetune: {stopped}; exit {EXIT_PREEMPTED}. Run the same command "
                      "again to continue the sweep.", file=sys.stderr, flush=True)
                return EXIT_PREEMPTED
            print(f"finetune: {trial['name']} {trial['status']}"
                  + (f": {sweep.metric} {trial['metric']:.6g}" if trial["metric"] is not None
                     else f" (exit {trial['exit_code']})"), flush=True)
            results.report(sweep_dir, state, f"{name} sweep ({sweep.method})")
    if signals.received:
        state["status"] = "stopped"
        runner.save(sweep_dir, state)
        print(f"finetune: stopped on {signals.received} between trials; exit "
              f"{EXIT_PREEMPTED}. Run the same command again to continue.", file=sys.stderr)
        return EXIT_PREEMPTED
    state["status"] = "finished"
    runner.save(sweep_dir, state)
    return 0
