"""The `finetune` command. Each subcommand imports what it needs when it runs, so
`--help` and `validate` never pay for torch or transformers."""

from __future__ import annotations

import argparse
import sys

from finetune import __version__

EXIT_USER_ERROR = 2


def _add_experiment_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("config", help="experiment YAML file")
    parser.add_argument("overrides", nargs="*", metavar="key.sub=value",
                        help="override a setting, typed as the schema says "
                             "(e.g. training.learning_rate=1e-4 peft.r=32)")


def _validate(args: argparse.Namespace) -> int:
    from finetune.config import load_experiment
    from finetune.rundir import resolved_yaml

    experiment = load_experiment(args.config, args.overrides)
    if args.print:
        sys.stdout.write(resolved_yaml(experiment))
    else:
        print(f"{args.config}: ok ({experiment.method}, model {experiment.model.name_or_path}, "
              f"peft {experiment.peft.type})")
    return 0


def _train(args: argparse.Namespace) -> int:
    from finetune.config import load_experiment
    from finetune.rundir import prepare_run_dir

    experiment = load_experiment(args.config, args.overrides)
    run_dir = prepare_run_dir(experiment)
    from finetune.worker import train  # heavy: torch, transformers, trl

    train(experiment, run_dir)
    return 0


def _reference(args: argparse.Namespace) -> int:
    from finetune.config.reference import markdown

    sys.stdout.write(markdown())
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="finetune",
        description="Fine-tune language models from a declarative YAML experiment.")
    parser.add_argument("--version", action="version", version=f"finetune {__version__}")
    commands = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)

    validate = commands.add_parser(
        "validate", help="check an experiment without loading anything heavy",
        description="Check an experiment: schema, training fields, files, cross-field rules. "
                    "Exit 0 if valid, 2 with one line per problem otherwise.")
    _add_experiment_args(validate)
    validate.add_argument("--print", action="store_true",
                          help="print the resolved experiment with every default filled")
    validate.set_defaults(func=_validate)

    train = commands.add_parser(
        "train", help="train in this process",
        description="Validate the experiment, write the run directory and train in this "
                    "process (CPU or one GPU).")
    _add_experiment_args(train)
    train.set_defaults(func=_train)

    reference = commands.add_parser(
        "reference", help="print every experiment key with its type, default and meaning",
        description="Print the experiment reference (Markdown), generated from the schema.")
    reference.set_defaults(func=_reference)
    return parser


def main(argv: list[str] | None = None) -> int:
    from finetune.errors import ConfigError, DataError, RunError

    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except ConfigError as exc:
        for problem in exc.problems:
            print(f"error: {problem}", file=sys.stderr)
        return EXIT_USER_ERROR
    except (DataError, RunError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return EXIT_USER_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return 130
