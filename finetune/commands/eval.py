"""`finetune eval RUN_DIR|EXPERIMENT [--data FILE] [--checkpoint N] [--out FILE]`: the
metrics training reports after training (the method trainer's evaluate(), and exact
match where asked), for a run's final model or one of its checkpoints (RUN_DIR, under
the run's own resolved experiment), or for an experiment's starting model (EXPERIMENT),
on the experiment's eval data or another file. Nothing is trained.

The result is written as JSON into the run directory's eval/ (a new file each time:
<data>-<model>.json, then -2, -3, ...) and printed as a table. This module is torch-free
at import (the CLI's parser imports it); eval_saved.py does the work."""

from __future__ import annotations

import argparse
import json
import os
import re
import time
from pathlib import Path
from typing import Any

from finetune import __version__
from finetune.errors import RunError

EVAL_DIR = "eval"
# Not properties of the model: timings, counters of the trainer's state.
NOT_SHOWN = ("runtime", "per_second", "preparation_time", "num_tokens", "epoch")
MAX_VERSIONS = 10_000


def _step(text: str) -> int:
    if not re.fullmatch(r"[0-9]{1,12}", text.strip()):
        raise argparse.ArgumentTypeError(f"expected a step number, got {text!r}")
    return int(text)


def add_commands(commands) -> None:
    """Register `finetune eval` with the CLI's subcommands."""
    parser = commands.add_parser(
        "eval", help="evaluate a run's model (or an experiment's starting model) on eval data",
        description="Evaluate without training: a run directory's final model (or "
                    "--checkpoint N) under the run's own resolved experiment, or an "
                    "experiment file's starting model, on the experiment's eval data (or "
                    "--data). Reports what training reports after training; writes it as "
                    "JSON into the run directory's eval/ and prints a table.")
    parser.add_argument("target", metavar="RUN_DIR|EXPERIMENT",
                        help="a run directory (holding experiment.yaml), or an experiment "
                             "YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="override a setting of the experiment (e.g. "
                             "training.per_device_eval_batch_size=8 distributed.device=cpu)")
    parser.add_argument("--data", metavar="FILE",
                        help="evaluate on this file (or directory of files) instead of the "
                             "experiment's data.eval")
    parser.add_argument("--checkpoint", type=_step, metavar="N",
                        help="evaluate checkpoints/checkpoint-N instead of final/")
    parser.add_argument("--exact-match", action="store_true",
                        help="also greedy exact match (evaluation.exact_match: true)")
    parser.add_argument("--out", metavar="FILE",
                        help="write the JSON here (default: RUN_DIR/eval/<data>-<model>.json)")
    parser.set_defaults(func=run)


def _single_process() -> list[str]:
    """Evaluation runs in this one process, with nothing reported or pushed anywhere."""
    return ["distributed.strategy=none", "distributed.num_machines=1",
            "distributed.num_processes=1", "distributed.processes_per_machine=1",
            "training.report_to=none", "training.push_to_hub=false"]


def _overrides(args: argparse.Namespace, run_dir: Path | None) -> list[str]:
    extra = [*args.overrides, *_single_process()]
    if run_dir is not None:  # the run may have been moved since it trained
        extra.append(f"output.dir={json.dumps(str(run_dir))}")
    if args.data is not None:
        data = Path(args.data).absolute()
        if not os.path.exists(data):
            raise RunError(f"--data {args.data}: no such file or directory")
        extra += [f"data.eval={json.dumps(str(data))}", "data.eval_fraction=null"]
    if args.exact_match:
        extra.append("evaluation.exact_match=true")
    return extra


def _target(args: argparse.Namespace):
    """(experiment, run directory, whether it is a run) from RUN_DIR or EXPERIMENT."""
    from finetune.config import load_experiment
    from finetune.rundir.paths import run_dir_of

    target = Path(args.target)
    if target.is_dir():
        run_dir = target.absolute()
        if not (run_dir / "experiment.yaml").is_file():
            raise RunError(f"{args.target} is a directory but not a run directory: it has no "
                           "experiment.yaml (give a run directory, or an experiment file)")
        experiment = load_experiment(str(run_dir / "experiment.yaml"), _overrides(args, run_dir))
        return experiment, run_dir, True
    if not target.is_file():
        raise RunError(f"{args.target}: no such run directory or experiment file")
    if args.checkpoint is not None:
        raise RunError(f"--checkpoint {args.checkpoint}: evaluates a checkpoint of a run; give "
                       "its run directory, not an experiment file")
    experiment = load_experiment(args.target, _overrides(args, None))
    return experiment, run_dir_of(experiment), False


def _listed(names: list[str]) -> str:
    return ", ".join(names) if names else "none"


def _weights(run_dir: Path, step: int | None) -> Path:
    """The saved model to evaluate: final/, or a complete checkpoint-N."""
    from finetune.rundir import checkpoints

    found = checkpoints.scan(run_dir / "checkpoints")
    complete = [str(checkpoints.step_of(p)) for p in found.complete]
    if step is not None:
        path = checkpoints.directory(run_dir / "checkpoints", step)
        if not path.is_dir():
            raise RunError(f"--checkpoint {step}: {run_dir} has no checkpoint-{step} (its "
                           f"complete checkpoints: {_listed(complete)})")
        why = checkpoints.problem(path)
        if why is not None:
            raise RunError(f"--checkpoint {step}: {path} cannot be evaluated: {why}")
        return path
    final = run_dir / "final"
    if final.is_dir():
        return final
    if complete:
        raise RunError(f"{run_dir} has no final model (final/): training has not finished, or "
                       "output.save_final is false. Evaluate a checkpoint with --checkpoint N "
                       f"(complete ones: {_listed(complete)})")
    raise RunError(f"{run_dir} has no final model (final/) and no complete checkpoint: "
                   "nothing to evaluate")


def _data_name(experiment) -> str:
    spec = experiment.data
    if spec.eval is None:
        return "eval_fraction"
    name = Path(spec.eval[0].path.rstrip("/")).name
    stem = name.split(".")[0] if "." in name[1:] else name
    return re.sub(r"[^A-Za-z0-9_-]+", "_", stem)[:80] or "eval"


def _check_out(path: Path) -> None:
    if os.path.lexists(path):
        raise RunError(f"--out {path}: exists; nothing was evaluated or written (choose "
                       "another file, or move that one away)")
    if not path.parent.is_dir():
        raise RunError(f"--out {path}: {path.parent} is not a directory")


def _write_new(text: str, out: Path | None, folder: Path, stem: str) -> Path:
    """Write `text` to a file no one has written: `out`, else folder/stem.json, then
    stem-2.json, ... Whole or not at all (written aside, then linked into place, which
    fails where a file exists: an earlier result is never replaced)."""
    targets = [out] if out else [folder / f"{stem}{'' if n == 1 else f'-{n}'}.json"
                                 for n in range(1, MAX_VERSIONS)]
    home = targets[0].parent
    try:
        home.mkdir(parents=True, exist_ok=True)
        staging = home / f".{targets[0].name}.tmp{os.getpid()}"
        staging.write_text(text)
    except OSError as exc:
        raise RunError(f"cannot write into {home}: {exc.strerror or exc}") from None
    try:
        for target in targets:
            try:
                os.link(staging, target)
                return target
            except FileExistsError:
                continue
            except OSError as exc:
                raise RunError(f"cannot write {target}: {exc.strerror or exc}") from None
        raise RunError(f"{targets[0]}: exists; nothing was written (choose another --out, "
                       "or move it away)")
    finally:
        staging.unlink(missing_ok=True)


def _table(record: dict[str, Any]) -> str:
    lines = [f"finetune: evaluated {record['model']}",
             f"  data       {', '.join(record['data'])} ({record['rows']} rows)",
             f"  hardware   {record['device']}, precision {record['precision']}"]
    for key, value in sorted(record["metrics"].items()):
        if isinstance(value, (int, float)) and not isinstance(value, bool) and \
                not any(word in key for word in NOT_SHOWN):
            lines.append(f"  {key:<28} {value:.4g}")
    return "\n".join(lines)


def _record(args: argparse.Namespace, experiment, run_dir: Path, weights: Path | None,
            result: dict[str, Any]) -> dict[str, Any]:
    """What the JSON file holds: what was evaluated, on what, where, and the metrics."""
    metrics = {k: v for k, v in result["metrics"].items()
               if k != "epoch" and not k.endswith("num_tokens")}  # the trainer's state
    data = [s.path for s in experiment.data.eval] if experiment.data.eval else \
        [f"data.eval_fraction {experiment.data.eval_fraction} of data.train"]
    model = str(weights) if weights else f"the starting model of {args.target} " \
        f"({experiment.model.name_or_path}, {experiment.model.init})"
    return {"finetune": __version__, "created": time.strftime("%Y-%m-%dT%H:%M:%S"),
            "experiment": experiment.name, "method": experiment.method,
            "run_dir": str(run_dir), "model": model, "checkpoint": args.checkpoint,
            "data": data, **result, "metrics": metrics}


def run(args: argparse.Namespace) -> int:
    experiment, run_dir, is_run = _target(args)
    out = Path(args.out).absolute() if args.out else None
    if out is not None:
        _check_out(out)
    elif not is_run:
        from finetune.rundir.paths import check_run_dir

        check_run_dir(run_dir)  # the result goes into its eval/
    if experiment.data.eval is None and experiment.data.eval_fraction is None:
        raise RunError(f"{args.target}: the experiment has no eval data (data.eval or "
                       "data.eval_fraction); give a file with --data FILE")
    weights = _weights(run_dir, args.checkpoint) if is_run else None
    if is_run and experiment.model.init == "random" and \
            not (run_dir / "init-model" / "config.json").is_file():
        raise RunError(f"{run_dir}/init-model/ is missing: the run started from random weights "
                       "saved there, which the evaluation starts from too (the reference "
                       "model, the base of an adapter)")

    if experiment.peft.type != "qlora":  # as `finetune train`: see cli._train
        import logging

        logging.getLogger("bitsandbytes.backends.cpu.ops").setLevel(logging.ERROR)
    from finetune.commands.eval_saved import evaluate_saved  # heavy: torch, transformers, trl

    result = evaluate_saved(experiment, run_dir, weights)
    record = _record(args, experiment, run_dir, weights, result)
    model_name = weights.name if weights else "start"
    path = _write_new(json.dumps(record, indent=2, default=str) + "\n", out,
                      run_dir / EVAL_DIR, f"{_data_name(experiment)}-{model_name}")
    print(_table(record))
    print(f"  written to {path}", flush=True)
    return 0
