"""`finetune data`: the command's parser (torch-free at import); the work is
data_view.py's, imported when the command runs."""

from __future__ import annotations

from typing import Any


def _main(args: Any) -> int:
    from finetune.config import load_experiment
    from finetune.commands.data_view import report

    print("\n".join(report(load_experiment(args.config, args.overrides), args.n)))
    return 0


def add_commands(commands) -> None:
    from finetune.commands.args import whole

    data = commands.add_parser(
        "data", help="show formatted rows, trained tokens and token lengths",
        description="Read and check the experiment's data as training will, then print N "
                    "rows as the model gets them (trained tokens between ⟦ and ⟧), the "
                    "token-length distribution, and how many rows the max length cuts and "
                    "the method's preparation drops.")
    data.add_argument("config", help="experiment YAML file")
    data.add_argument("overrides", nargs="*", metavar="key.sub=value",
                      help="override a setting (e.g. training.max_length=512)")
    data.add_argument("-n", type=whole(0, 1000), default=3, help="rows to show (default 3)")
    data.set_defaults(func=_main)
