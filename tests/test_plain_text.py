"""A .txt corpus for continued pretraining (data/plain_text.py): one document per
blank-line-separated block when the file has a blank line between lines of text, else one
per line; blank lines skipped and counted in the note; validate reads it as training does."""

from __future__ import annotations

import pytest

from conftest import TINY_MODEL, run_cli
from finetune.config import load_experiment
from finetune.data.load import load_data


def experiment(write, path):
    return write("exp.yaml", f"method: sft\nmodel:\n  name_or_path: {TINY_MODEL}\n"
                             f"data:\n  train: {path}\n")


def test_a_file_with_blank_lines_between_text_is_one_document_per_block(write, tmp_path):
    path = tmp_path / "corpus.txt"
    path.write_text("\n\nFirst article,\nits second line.\n\n  \n\nSecond article.\n\n")
    splits = load_data(load_experiment(experiment(write, path)))
    assert splits.format == "text"
    assert splits.train["text"] == ["First article,\nits second line.", "Second article."]
    assert splits.notes == [f"{path}: plain text read as 2 document(s), one per "
                            "blank-line-separated block; 6 blank line(s) skipped"]


def lines_file(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("\ufeffone line\r\nanother line\r\nthird\r\n\r\n")
    return path


def test_a_file_without_them_is_one_document_per_line(write, tmp_path):
    path = lines_file(tmp_path)
    splits = load_data(load_experiment(experiment(write, path)))
    assert splits.train["text"] == ["one line", "another line", "third"]
    assert "3 document(s), one per line (no blank line between two lines of text); 1 blank " \
           "line(s) skipped" in splits.notes[0]


@pytest.mark.slow  # a CLI process
def test_validate_reads_a_text_file_as_training_does(write, tmp_path):
    path = lines_file(tmp_path)
    result = run_cli("validate", str(experiment(write, path)), cwd=tmp_path)
    assert result.returncode == 0, result.stderr
    assert f"data.train[0]: {path}: 3 rows, format text" in result.stdout


def test_a_readme_beside_data_files_is_not_data(tmp_path):
    from finetune.data.files import list_data_files

    (tmp_path / "rows.jsonl").write_text('{"text": "a"}\n')
    (tmp_path / "README.txt").write_text("what these rows are\n")
    assert list_data_files(tmp_path) == [tmp_path / "rows.jsonl"]
    (tmp_path / "rows.jsonl").unlink()
    assert list_data_files(tmp_path) == [tmp_path / "README.txt"]  # a corpus of .txt
