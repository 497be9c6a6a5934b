#!/usr/bin/env python
"""Summaries and tables of a bench/run.py results file. Medians over the repetitions;
ratios are finetune's tokens/s over the other contender's (above 1: finetune faster).

Usage: python bench/table.py results.json [more.json ...] [--markdown]
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

ORDER = ["finetune", "defaults", "tuned", "same"]
LABELS = {"finetune": "finetune", "defaults": "plain TRL, defaults",
          "tuned": "plain TRL, packing (bfd)", "same": "plain TRL, finetune's settings"}
OVERHEAD_TARGET = 0.05


def _median(values):
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summarize(runs: list[dict]) -> dict:
    """Per contender: medians (and the tokens/s range) of its successful runs; ratios."""
    out: dict = {"contenders": {}}
    for name in ORDER:
        ok = [r["result"] for r in runs if r["contender"] == name and r.get("result")]
        failed = sum(1 for r in runs if r["contender"] == name and not r.get("result"))
        if not ok and not failed:
            continue
        tps = [r["tokens_per_s"] for r in ok]
        out["contenders"][name] = {
            "runs": len(ok), "failed": failed,
            "tokens_per_s": _median(tps), "tokens_per_s_min": min(tps, default=None),
            "tokens_per_s_max": max(tps, default=None),
            "s_per_step": _median([r["s_per_step"] for r in ok]),
            "tokens_per_step": _median([r["tokens"] / r["steps"] for r in ok]),
            "padding_fraction": _median([r.get("padding_fraction") for r in ok]),
            "peak_mem_bytes": _median([r.get("peak_mem_bytes") for r in ok]),
            "mfu": _median([r.get("mfu") for r in ok]),
        }
    table = out["contenders"]
    ft = table.get("finetune", {}).get("tokens_per_s")
    for row in table.values():
        row["finetune_over_this"] = round(ft / row["tokens_per_s"], 4) \
            if ft and row["tokens_per_s"] else None
    out["overhead"] = _overhead(runs)
    return out


def _overhead(runs: list[dict]) -> dict | None:
    """finetune's s/step (wall time) over plain TRL's with finetune's settings, paired by
    repetition (each pair ran in the same rotation, close in time, so slow drift of the
    machine cancels); the verdict is the median over the pairs."""
    by_rep: dict[int, dict] = {}
    for r in runs:
        if r.get("result") and r["contender"] in ("finetune", "same"):
            by_rep.setdefault(r["repeat"], {})[r["contender"]] = r["result"]
    pairs = [(p["finetune"], p["same"]) for p in by_rep.values() if len(p) == 2]
    if not pairs:
        return None
    ratios = [f["s_per_step"] / s["s_per_step"] - 1 for f, s in pairs]
    # The same batches: every step's trained tokens (TRL's num_tokens) equal on both sides.
    return {"paired_s_per_step": round(statistics.median(ratios), 4),
            "per_repeat": [round(x, 4) for x in ratios],
            "same_batches": all(f["tokens_by_step"] == s["tokens_by_step"] for f, s in pairs),
            "target": OVERHEAD_TARGET}


def _fmt(value, spec="{:,.0f}", none="–"):
    return none if value is None else spec.format(value)


def rows(summary: dict) -> list[list[str]]:
    header = ["contender", "tokens/s (median; min–max)", "s/step", "tokens/step", "padding",
              "peak mem", "MFU", "finetune ÷ this"]
    body = [header]
    for name, row in summary["contenders"].items():
        spread = f" ({_fmt(row['tokens_per_s_min'])}–{_fmt(row['tokens_per_s_max'])})" \
            if row["runs"] > 1 else ""
        failed = f" [{row['failed']} failed]" if row["failed"] else ""
        body.append([
            LABELS[name] + failed, _fmt(row["tokens_per_s"]) + spread,
            _fmt(row["s_per_step"], "{:.3f}"), _fmt(row["tokens_per_step"]),
            _fmt(row["padding_fraction"], "{:.1%}"),
            _fmt(None if row["peak_mem_bytes"] is None else row["peak_mem_bytes"] / 2**30,
                 "{:.2f} GiB", "n/a"),
            _fmt(row["mfu"], "{:.1%}", "n/a"), _fmt(row["finetune_over_this"], "{:.2f}×")])
    return body


def overhead_line(summary: dict) -> str:
    """The verdict goes by wall time, paired by repetition (docs/benchmarks.md)."""
    over = summary.get("overhead")
    if not over:
        return "finetune's own overhead: not measured (needs the finetune and same runs)"
    verdict = ("within" if over["paired_s_per_step"] <= over["target"] else "ABOVE") + \
        f" the {over['target']:.0%} target"
    spread = max(over["per_repeat"]) - min(over["per_repeat"])
    if spread > 2 * over["target"]:  # the machine's noise swamps what is being judged
        verdict = (f"inconclusive: the pairs spread over {spread:.0%}, more than twice the "
                   f"target (the median alone is {verdict})")
    note = "" if over["same_batches"] else \
        " (WARNING: the two trained different batches: per-step num_tokens differ)"
    return (f"finetune's own per-step overhead vs plain TRL with finetune's settings: "
            f"{over['paired_s_per_step']:+.1%} s/step, wall time (median of per-repeat pairs "
            f"{', '.join(f'{x:+.1%}' for x in over['per_repeat'])}); {verdict}{note}")


def setup_line(results: dict) -> str:
    s, lengths = results["settings"], results["data"]["lengths"]
    model = s["model"].split("/bench/", 1)[-1]
    kind = "dense" if s.get("data") == "dense" else "log-normal"
    threads = f", {s['threads']} thread(s) per run" if s.get("threads") else ""
    return (f"Model `{model}` ({'LoRA r=16' if s['lora'] else 'full fine-tuning'}), "
            f"{s['precision']}, {s['device']}{threads}, batch {s['batch_size']}, max_length "
            f"{s['max_length']}, {s['steps']} steps (the first {s['warmup_steps']} not timed), "
            f"{s['repeats']} repeats interleaved. Data: {lengths['rows']} {kind} rows, "
            f"tokens per row "
            f"min {lengths['min']} / median {lengths['median']:g} / mean {lengths['mean']} / "
            f"p90 {lengths['p90']} / max {lengths['max']}.")


def markdown(results: dict) -> str:
    body = rows(results["summary"])
    lines = ["| " + " | ".join(body[0]) + " |", "|" + "---|" * len(body[0])]
    lines += ["| " + " | ".join(r) + " |" for r in body[1:]]
    lines += ["", overhead_line(results["summary"]) + ".", "", setup_line(results)]
    return "\n".join(lines)


def text(results: dict) -> str:
    body = rows(results["summary"])
    widths = [max(len(r[i]) for r in body) for i in range(len(body[0]))]
    lines = ["  ".join(c.ljust(w) for c, w in zip(r, widths)) for r in body]
    lines.insert(1, "  ".join("-" * w for w in widths))
    return "\n".join(lines + ["", overhead_line(results["summary"]), setup_line(results)])


def merge(files: list[Path]) -> dict:
    """Several results files of the same settings as one (e.g. contenders split over
    calls to fit a time limit): runs pooled, repeats renumbered per file; the overhead
    pairs need finetune and same in the same file."""
    merged = None
    for index, path in enumerate(files):
        results = json.loads(path.read_text())
        runs = [{**r, "repeat": index * 1000 + r["repeat"]} for r in results["runs"]]
        if merged is None:
            merged = {**results, "runs": runs}
            continue
        keys = ("device", "model", "lora", "steps", "warmup_steps", "batch_size",
                "max_length", "precision", "attn", "data")
        if any(results["settings"].get(k) != merged["settings"].get(k) for k in keys):
            raise SystemExit(f"{path}: other settings than {files[0]}")
        merged["runs"] += runs
    merged["settings"]["repeats"] = max(
        sum(1 for r in merged["runs"] if r["contender"] == c) for c in ORDER)
    merged["summary"] = summarize(merged["runs"])
    return merged


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("results", type=Path, nargs="+", help="one or more results files")
    parser.add_argument("--markdown", action="store_true")
    args = parser.parse_args()
    results = merge(args.results)
    print(markdown(results) if args.markdown else text(results))


if __name__ == "__main__":
    main()
