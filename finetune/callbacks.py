"""Trainer callbacks: every log and eval event appended to metrics.jsonl (main process)."""

from __future__ import annotations

import json
import math
import time
from pathlib import Path

from transformers import TrainerCallback


def _clean(value):
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


class MetricsFile(TrainerCallback):
    def __init__(self, path: Path):
        self.path = path

    def write(self, record: dict) -> None:
        with self.path.open("a") as handle:
            handle.write(json.dumps({k: _clean(v) for k, v in record.items()}) + "\n")

    def on_log(self, args, state, control, logs=None, **kwargs):
        if state.is_world_process_zero and logs:
            self.write({"step": state.global_step, "epoch": state.epoch,
                        "time": round(time.time(), 3), **logs})


def read_metrics(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
