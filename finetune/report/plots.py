"""A run's curves from its metrics.jsonl: the loss.png every run writes, and `finetune plot`,
which draws one run or overlays several. Torch-free; matplotlib with the Agg backend (no
display needed), imported only when a figure is drawn."""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from pathlib import Path

from finetune.errors import RunError


@dataclass(frozen=True)
class Panel:
    """One axis: a run's line is the first `train` key it logs, its points the first
    `evals` key (the methods name the same quantity differently)."""

    label: str
    train: tuple[str, ...]
    evals: tuple[str, ...] = ()
    height: float = 2.0


PANELS = (
    Panel("loss", ("loss",), ("eval_loss",), 3.0),
    # grpo (TRL's GRPOTrainer) logs reward and kl; ppo (ours) ppo/reward_mean and ppo/kl
    Panel("reward", ("reward", "ppo/reward_mean"), ("eval_reward", "eval_reward_mean")),
    Panel("KL to reference", ("kl", "ppo/kl"), ("eval_kl",)),
    Panel("learning rate", ("learning_rate",), (), 1.5),
)
SHOWN_NOTES = 5  # damaged lines named per run; the rest are counted


@dataclass
class Run:
    label: str  # the legend's name for it
    title: str  # "name (method)"
    records: list[dict]
    dropped: list[str]  # one note per metrics.jsonl line that is not a record


def points(records: list[dict], key: str) -> list[tuple[int, float]]:
    # A non-finite value is logged as text ("nan"): not a point; nor is a bool.
    return [(r["step"], float(r[key])) for r in records
            if isinstance(r.get(key), (int, float)) and not isinstance(r[key], bool)]


def read_run(run_dir: Path) -> Run:
    """The run's records (damaged lines dropped, each noted); RunError for a directory
    that holds no metrics.jsonl."""
    from finetune.rundir.paths import metrics_records

    if not run_dir.is_dir():
        raise RunError(f"{run_dir}: no such run directory")
    path = run_dir / "metrics.jsonl"
    if not path.exists():
        raise RunError(f"{run_dir}: no metrics.jsonl: not a run directory, or a run that "
                       "has logged nothing yet")
    records, dropped = metrics_records(path)
    name, method = _name_and_method(run_dir)
    return Run(label=name, title=f"{name} ({method})" if method else name,
               records=records, dropped=dropped)


def _name_and_method(run_dir: Path) -> tuple[str, str | None]:
    """From the run's experiment.yaml when it is readable (it is the run's own record, but
    only a label depends on it), else the directory's name."""
    import yaml

    try:
        resolved = yaml.safe_load((run_dir / "experiment.yaml").read_text())
    except (OSError, UnicodeDecodeError, yaml.YAMLError, RecursionError):
        resolved = None
    if not isinstance(resolved, dict):
        return run_dir.name, None
    name, method = resolved.get("name"), resolved.get("method")
    return (name if isinstance(name, str) and name else run_dir.name,
            method if isinstance(method, str) else None)


def metric_panels(keys: list[str]) -> tuple[Panel, ...]:
    """--metric KEY: KEY as a line (as points for an eval_ key), eval_KEY as points."""
    return tuple(Panel(key, (), (key,)) if key.startswith("eval_")
                 else Panel(key, (key,), (f"eval_{key}",)) for key in keys)


def _first_logged(records: list[dict], keys: tuple[str, ...]) -> list[tuple[int, float]]:
    for key in keys:
        found = points(records, key)
        if found:
            return found
    return []


def _series(runs: list[Run], panels: tuple[Panel, ...]) -> list[tuple[Panel, list]]:
    """Each panel some run has data for, with each run's (train, eval) points."""
    drawn = []
    for panel in panels:
        per_run = [(_first_logged(run.records, panel.train),
                    _first_logged(run.records, panel.evals)) for run in runs]
        if any(train or evals for train, evals in per_run):
            drawn.append((panel, per_run))
    return drawn


def figure(runs: list[Run], panels: tuple[Panel, ...] = PANELS, title: str | None = None):
    """One panel per quantity some run logged, stacked over a shared step axis; a line per
    run for training, points for evaluations. None when nothing is plottable."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.lines import Line2D

    drawn = _series(runs, panels)
    if not drawn:
        return None
    heights = [panel.height for panel, _ in drawn]
    fig = Figure(figsize=(8, 0.9 + sum(heights)), layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(len(drawn), 1, sharex=True, squeeze=False,
                        height_ratios=heights)[:, 0]
    several = len(runs) > 1
    for ax, (panel, per_run) in zip(axes, drawn):
        for index, (run, (train, evals)) in enumerate(zip(runs, per_run)):
            line_color, eval_color = (f"C{index % 10}",) * 2 if several else ("C0", "C1")
            if train:
                ax.plot(*zip(*train), color=line_color, linewidth=1.4,
                        label=f"{run.label} train" if several else "train")
            if evals:
                ax.plot(*zip(*evals), linestyle="none", marker="o", markersize=5,
                        color=eval_color, markeredgecolor="white", markeredgewidth=0.6,
                        label=f"{run.label} eval" if several else "eval")
        ax.set_ylabel(panel.label)
        ax.grid(alpha=0.3)
        ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
        if not several and len(ax.get_lines()) > 1:
            ax.legend(loc="best", fontsize="small")
    axes[-1].set_xlabel("optimizer step")
    if several:  # one legend for every panel: a colour per run, a style per kind
        handles = [Line2D([], [], color=f"C{i % 10}", linewidth=2, label=run.label)
                   for i, run in enumerate(runs)]
        handles += [Line2D([], [], color="gray", linewidth=1.4, label="train"),
                    Line2D([], [], color="gray", linestyle="none", marker="o", label="eval")]
        fig.legend(handles=handles, loc="outside upper center", fontsize="small",
                   ncols=min(len(handles), 6), frameon=False)
    if title:
        fig.suptitle(title)
    return fig


def save(fig, path: Path) -> None:
    try:
        fig.savefig(path, dpi=100)
    except OSError as exc:
        raise RunError(f"cannot write {path}: {exc.strerror or exc}") from None


def write_loss_plot(run_dir: Path, title: str) -> bool:
    """loss.png of a run that has ended (the worker, rank 0); False if nothing was logged."""
    if not (run_dir / "metrics.jsonl").exists():
        return False
    run = read_run(run_dir)
    fig = figure([run], title=title)
    if fig is None:
        return False
    save(fig, run_dir / "loss.png")
    return True


# ---- finetune plot ----

def add_commands(commands) -> None:
    plot = commands.add_parser(
        "plot", help="draw a run's curves, or overlay several runs",
        description="Draw loss (eval as points), reward and KL (grpo, ppo) and learning "
                    "rate from each run directory's metrics.jsonl; several runs are "
                    "overlaid, one colour per run. No torch needed.")
    plot.add_argument("run_dirs", nargs="+", metavar="RUN_DIR", help="run directory")
    plot.add_argument("--out", metavar="FILE",
                      help="image to write (.png, .pdf, .svg...); default RUN_DIR/loss.png "
                           "for one run, required for several or with --metric")
    plot.add_argument("--metric", action="append", metavar="KEY",
                      help="plot this metrics.jsonl key instead (and eval_KEY as points); "
                           "repeat for more panels")
    plot.set_defaults(func=command)


def command(args: argparse.Namespace) -> int:
    dirs = [Path(d) for d in args.run_dirs]
    if args.out is None and (len(dirs) > 1 or args.metric):
        raise RunError("--out FILE is needed to plot several runs or --metric (one run's "
                       "default is its own loss.png)")
    out = Path(args.out) if args.out else dirs[0] / "loss.png"
    _check_format(out)
    runs = _labelled([read_run(d) for d in dirs], dirs)
    for run, run_dir in zip(runs, dirs):
        for note in run.dropped[:SHOWN_NOTES]:
            print(f"finetune: note: {note} from the plot")
        if len(run.dropped) > SHOWN_NOTES:
            print(f"finetune: note: {run_dir / 'metrics.jsonl'}: "
                  f"{len(run.dropped) - SHOWN_NOTES} more damaged lines dropped from the plot")
    panels = metric_panels(args.metric) if args.metric else PANELS
    fig = figure(runs, panels, runs[0].title if len(runs) == 1 else None)
    if fig is None:
        raise RunError(_nothing_to_plot(runs, dirs, args.metric))
    save(fig, out)
    print(f"finetune: wrote {out}")
    return 0


def _labelled(runs: list[Run], dirs: list[Path]) -> list[Run]:
    """Runs of the same name (a run and its copy elsewhere) are told apart by path."""
    labels = [run.label for run in runs]
    for run, run_dir in zip(runs, dirs):
        if labels.count(run.label) > 1:
            run.label = str(run_dir)
    return runs


def _check_format(out: Path) -> None:
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    if out.is_dir():
        raise RunError(f"--out {out} is a directory; name the image file to write")
    formats = FigureCanvasAgg(Figure()).get_supported_filetypes()
    if out.suffix.lower().lstrip(".") not in formats:
        raise RunError(f"--out {out}: the file name's ending says the image format; one of "
                       f"{', '.join('.' + f for f in sorted(formats))}")


def _nothing_to_plot(runs: list[Run], dirs: list[Path], metrics: list[str] | None) -> str:
    import difflib

    logged = sorted({key for run in runs for r in run.records for key, value in r.items()
                     if isinstance(value, (int, float)) and key != "step"})
    where = ", ".join(str(d / "metrics.jsonl") for d in dirs)
    if not metrics:
        return f"nothing to plot: no loss, reward, KL or learning rate logged in {where}"
    close = sorted({m for key in metrics for m in difflib.get_close_matches(key, logged, 3)})
    hint = f"; did you mean {', '.join(close)}?" if close else \
        f"; logged keys: {', '.join(logged[:20])}" if logged else ""
    return f"--metric {', '.join(metrics)}: not logged in {where}{hint}"

