"""Committed files that are generated must equal what their generator makes today."""

from __future__ import annotations

import filecmp
import json
import subprocess
import sys

import pytest

from conftest import QUICKSTART, REPO
from finetune.config import trl_fields


def test_trl_field_manifest_matches_installed_trl():
    committed = json.loads(trl_fields.MANIFEST.read_text())
    assert committed == trl_fields.generate(), \
        "run `python -m finetune.config.trl_fields` and commit finetune/config/trl_fields.json"


@pytest.mark.slow
@pytest.mark.parametrize("script", ["make_assets.py", "make_vlm_assets.py"])
def test_quickstart_assets_regenerate_identically(tmp_path, script):
    subprocess.run([sys.executable, str(QUICKSTART / script),
                    "--out", str(tmp_path)], check=True, capture_output=True)
    for path in sorted(p for p in tmp_path.rglob("*") if p.is_file()):
        committed = QUICKSTART / path.relative_to(tmp_path)
        assert committed.exists() and filecmp.cmp(path, committed, shallow=False), committed


def test_experiment_reference_doc_is_current():
    from finetune.config.reference import markdown

    assert (REPO / "docs" / "experiment.md").read_text() == markdown(), \
        "run `finetune reference > docs/experiment.md`"


def test_docs_and_reference_list_every_method():
    """The reference's methods table is generated from the records; the table of
    docs/methods.md and the `method:` comment of docs/experiment-file.md's example are
    written by hand, so they are checked here."""
    from finetune.config.methods import METHODS
    from finetune.config.reference import markdown

    names = list(METHODS)
    reference = markdown()
    assert [line.split("`")[1] for line in reference.splitlines()
            if line.startswith("| `") and line.split("`")[1] in METHODS] == names
    example = (REPO / "docs" / "experiment-file.md").read_text()
    comment = next(line for line in example.splitlines() if line.startswith("method: "))
    assert [w.strip() for w in comment.split("#")[1].split("|")] == names, comment
    methods = (REPO / "docs" / "methods.md").read_text()
    table = methods.split("\n## Methods and data\n\n")[1].split("\n\n")[0]
    assert [row.split("`")[1] for row in table.splitlines()[2:]] == names, table
