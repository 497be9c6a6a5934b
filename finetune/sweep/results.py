"""What a sweep reports: the table of its trials (printed, and sweep_results.csv), the
best trial, and sweep.png, the metric of each trial (plots.py's style). Torch-free."""

from __future__ import annotations

import csv
import io
from pathlib import Path
from typing import Any

from finetune.errors import RunError

RESULTS = "sweep_results.csv"
PLOT = "sweep.png"


def best(state: dict[str, Any]) -> dict[str, Any] | None:
    done = [t for t in state["trials"] if t["status"] == "finished" and t["metric"] is not None]
    if not done:
        return None
    pick = min if state["goal"] == "minimize" else max
    return pick(done, key=lambda t: t["metric"])


def _shown(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    return "" if value is None else str(value)


def rows(state: dict[str, Any]) -> tuple[list[str], list[list[str]]]:
    keys = list(state["sweep"]["parameters"])
    header = ["trial", "status", *keys, state["metric"], "run_dir"]
    body = [[t["name"], t["status"], *(_shown(t["params"].get(k)) for k in keys),
             _shown(t.get("metric")), t["run_dir"]] for t in state["trials"]]
    return header, body


def table(state: dict[str, Any]) -> str:
    """An aligned text table, the best trial marked with *."""
    header, body = rows(state)
    top = best(state)
    marked = [[("* " if top is not None and row[0] == top["name"] else "  ") + row[0], *row[1:]]
              for row in body]
    cells = [["  " + header[0], *header[1:]], *marked]
    widths = [max(len(row[i]) for row in cells) for i in range(len(header) - 1)]
    lines = ["  ".join(c.ljust(w) for c, w in zip(row, widths)).rstrip() for row in cells]
    return "\n".join(lines)


def write_csv(sweep_dir: Path, state: dict[str, Any]) -> Path:
    from finetune.fileio.atomic import write_atomic

    header, body = rows(state)
    text = io.StringIO()
    writer = csv.writer(text, lineterminator="\n")
    writer.writerow(header)
    # full precision in the file; the printed table rounds
    for trial, row in zip(state["trials"], body):
        metric = trial.get("metric")
        writer.writerow([*row[:-2], "" if metric is None else repr(metric), row[-1]])
    write_atomic(sweep_dir / RESULTS, text.getvalue())
    return sweep_dir / RESULTS


def plot(sweep_dir: Path, state: dict[str, Any], title: str) -> Path | None:
    """The metric of each trial (a point per trial, the best one ringed); None when no
    trial has a value yet."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from finetune.report.plots import save

    finished = [(t["number"], t["metric"]) for t in state["trials"]
                if t["status"] == "finished" and t.get("metric") is not None]
    pruned = [(t["number"], t["metric"]) for t in state["trials"]
              if t["status"] == "pruned" and t.get("metric") is not None]
    if not finished and not pruned:
        return None
    fig = Figure(figsize=(8, 3.5), layout="constrained")
    FigureCanvasAgg(fig)
    ax = fig.subplots()
    if finished:
        ax.plot(*zip(*finished), linestyle="none", marker="o", markersize=6, color="C0",
                markeredgecolor="white", markeredgewidth=0.6, label="finished")
    if pruned:
        ax.plot(*zip(*pruned), linestyle="none", marker="x", markersize=6, color="C3",
                label="pruned (last evaluation)")
    top = best(state)
    if top is not None:
        ax.plot([top["number"]], [top["metric"]], linestyle="none", marker="o", markersize=13,
                markerfacecolor="none", markeredgecolor="C1", markeredgewidth=1.5,
                label=f"best: {top['name']}")
    ax.set_xlabel("trial")
    ax.set_ylabel(state["metric"])
    ax.grid(alpha=0.3)
    ax.ticklabel_format(axis="y", style="sci", scilimits=(-3, 4), useOffset=False)
    ax.xaxis.get_major_locator().set_params(integer=True)
    ax.legend(loc="best", fontsize="small")
    fig.suptitle(title)
    save(fig, sweep_dir / PLOT)
    return sweep_dir / PLOT


def report(sweep_dir: Path, state: dict[str, Any], title: str) -> None:
    """Write the table and the plot (a plot that cannot be drawn is only a warning)."""
    write_csv(sweep_dir, state)
    try:
        plot(sweep_dir, state, title)
    except RunError as exc:
        print(f"finetune: warning: no sweep plot: {exc}")
