"""A run directory damaged between attempts (by hand, a tool, a disk): whatever the
damage, nothing already written is lost: an error names the file, or the run goes on from
what is intact and says what it set aside."""

from __future__ import annotations

import json

import pytest

from finetune.callbacks import read_metrics, truncate_metrics
from finetune.errors import RunError


def test_damaged_metrics_lines_are_dropped_with_a_note_naming_each(tmp_path):
    path = tmp_path / "metrics.jsonl"
    good = [{"step": 1, "loss": 2.0}, {"step": 2, "loss": 1.5}]
    path.write_text(json.dumps(good[0]) + "\n[1, 2]\n" + '{"step": "5"}\n{"step": true}\n'
                    + json.dumps(good[1]) + "\n" + '{"step": 3, "lo')
    assert read_metrics(path) == good
    notes = truncate_metrics(path, 2)
    assert notes == [f"{path} line {n}: not a JSON object with a step number; dropped"
                     for n in (2, 3, 4)] + [
        f"{path} line 6: half-written, as a kill mid-append leaves it; dropped"]
    assert read_metrics(path) == good and path.read_text().endswith("}\n")
    assert truncate_metrics(path, None) == [] and path.read_text() == ""  # from scratch

    path.unlink()
    path.mkdir()
    with pytest.raises(RunError, match=f"cannot read {path} \\(Is a directory\\)"):
        read_metrics(path)
